"""DCP planners and storage for pieces of global tensors, and a reader that unpickles nothing untrusted.

A "piece table" maps each key to ``(global shape, [(offsets, view), ...])``
(:mod:`omnitron.core.checkpoint.dist_layout` builds it). :class:`PieceSavePlanner` turns it into DCP
write items (each piece written from its view, not copied: :func:`exact_storage`);
:class:`PieceLoadPlanner` reads each piece straight into its view, from whichever saved chunks overlap
it (DCP's resharding), so a rank reads only its slices. DCP's global-plan validation (no overlap, full coverage) runs on
save.

:class:`VerifiedReader`: DCP's ``.metadata`` is a pickle. It is read only after its SHA-256 matches
the one metadata.json records, and through an unpickler that admits DCP's metadata dataclasses and
torch's size/dtype types only; every saved chunk a rank reads is checksum-verified first, against its data
file's chunk index (``integrity.write_chunk_index``; the index's own checksum is in metadata.json), so a reader
hashes what it reads, not each whole file it touches.
"""
from __future__ import annotations

import io
import os
import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_meta
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.planner import LoadPlan

from omnitron.core.checkpoint import integrity
from omnitron.core.checkpoint.io import LOAD_EARLIER, CheckpointError, bare_file_name, zip_record_problem

Pieces = dict[str, tuple[tuple[int, ...], list[tuple[tuple[int, ...], torch.Tensor]]]]


class PieceSavePlanner(DefaultSavePlanner):
    """Writes the pieces of a piece table (passed as DCP's ``state_dict``)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.pieces: Pieces = state_dict
        self.state_dict = {}
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, (shape, pieces) in self.pieces.items():
            for off, view in pieces:
                chunk = dcp_meta.ChunkStorageMetadata(offsets=torch.Size(off), sizes=view.shape)
                props = dcp_meta.TensorProperties(dtype=view.dtype)
                items.append(WriteItem(index=dcp_meta.MetadataIndex(key, torch.Size(off)), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(chunk=chunk, properties=props,
                                                                   size=torch.Size(shape))))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        off = tuple(write_item.index.offset)
        for o, view in self.pieces[write_item.index.fqn][1]:
            if o == off:
                return exact_storage(view.detach())
        raise KeyError(write_item.index)


def exact_storage(view: torch.Tensor) -> torch.Tensor:
    """``view`` (host memory, contiguous) as a tensor sharing its memory whose storage is exactly its bytes.

    DCP's writer clones every tensor whose storage is larger than it (torch.save writes a tensor's whole
    storage), and keeps each clone until the rank's file is written: for pieces that are views of the flat
    parameter and optimizer buffers, a second copy of everything the rank writes. Through numpy (the one
    public way to make a storage over existing memory) the piece gets a storage of its own extent, holding
    the buffer alive, so nothing is copied. Other tensors (a device's: DCP copies them to the host anyway;
    non-contiguous narrowings) are returned as they are."""
    if view.device.type != "cpu" or not view.is_contiguous() or view.untyped_storage().nbytes() == view.nbytes \
            or view.numel() == 0:
        return view
    raw = view.reshape(-1).view(torch.uint8).numpy()  # a numpy view of the piece's bytes (any dtype, bf16 too)
    return torch.from_numpy(raw).view(view.dtype).view(view.shape)


def _model_mismatch(path: str, absent: list[str], saved: dict, pieces: dict) -> CheckpointError:
    """:func:`~omnitron.core.checkpoint.name_mismatch.mismatch_error` for the model weights in ``absent``. The
    checkpoint's weights this rank lacks count under the top-level modules of those missing (other pipeline stages'
    are the checkpoint's too), less per-layer ones (``.layers.N``: other stages' layers)."""
    from omnitron.core.checkpoint.name_mismatch import mismatch_error

    missing = [k.removeprefix("model/") for k in absent if k.startswith("model/")]
    tops = {k.split(".", 1)[0] for k in missing}
    unexpected = [k.removeprefix("model/") for k in saved if k.startswith("model/") and k not in pieces
                  and k.removeprefix("model/").split(".", 1)[0] in tops and ".layers." not in k]
    return mismatch_error(path, missing, unexpected)


class PieceLoadPlanner(DefaultLoadPlanner):
    """Reads each piece of a piece table into its view (``path`` names the checkpoint in errors)."""

    def __init__(self, path: str) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.path = path

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.pieces: Pieces = state_dict
        self.state_dict = {}
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items, saved = [], self.metadata.state_dict_metadata
        absent = [k for k in self.pieces if not isinstance(saved.get(k), dcp_meta.TensorStorageMetadata)]
        if any(k.startswith("model/") for k in absent):
            raise _model_mismatch(self.path, absent, saved, self.pieces)
        for key, (shape, pieces) in self.pieces.items():
            md = saved.get(key)
            if not isinstance(md, dcp_meta.TensorStorageMetadata):
                raise CheckpointError(f"{self.path}: the checkpoint holds no optimizer tensor {key!r}; it was saved "
                                      f"with another optimizer (pass --no-load-optim to take the weights only)")
            if tuple(md.size) != tuple(shape):
                raise CheckpointError(f"{self.path}: {key} is {tuple(md.size)} in the checkpoint, {tuple(shape)} "
                                      f"here; use the checkpoint's model settings")
            chunks = [dcp_meta.ChunkStorageMetadata(offsets=torch.Size(o), sizes=v.shape) for o, v in pieces]
            items += create_read_items_for_chunk_list(key, md, chunks)
        self.plan = LoadPlan(items)
        return self.plan

    def resolve_tensor(self, read_item) -> torch.Tensor:
        view = self.pieces[read_item.dest_index.fqn][1][read_item.dest_index.index][1]
        for dim, (off, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, off, n)
        return view

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        """Nothing: :meth:`resolve_tensor` handed out the live view, which the reader filled."""


_ALLOWED = {("torch.distributed.checkpoint.metadata", n) for n in
            ("Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties", "BytesStorageMetadata",
             "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")}
# Megatron-Core's .metadata also keeps the save plans it caches (plain dataclasses and an enum)
_ALLOWED |= {("torch.distributed.checkpoint.planner", n) for n in
             ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")}
_ALLOWED |= {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
             ("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2"), ("torch", "layout"),
             ("torch", "memory_format"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), (
                torch.dtype, torch.layout, torch.memory_format))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


def read_dcp_metadata(path: str, fix: str = "load an earlier iteration, or re-save") -> dcp_meta.Metadata:
    """DCP's ``Metadata`` of checkpoint directory ``path``'s ``.metadata`` through :class:`_MetadataUnpickler`
    (nothing but DCP's dataclasses and torch's size / dtype types is built); one CheckpointError naming
    ``fix`` when it is missing, unreadable or something else."""
    try:
        with open(f"{path}/.metadata", "rb") as f:
            md = _MetadataUnpickler(io.BytesIO(f.read())).load()
    except Exception as err:
        raise CheckpointError(f"{path}/.metadata is unreadable ({err}); {fix}") from None
    if not isinstance(md, dcp_meta.Metadata):
        raise CheckpointError(f"{path}/.metadata holds a {type(md).__name__}, not DCP's Metadata; {fix}")
    for info in (md.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not bare_file_name(name):
            raise CheckpointError(f"{path}/.metadata: data file {str(name)[:200]!r} is not a file name in the "
                                  f"checkpoint's directory (DCP writes bare names); refusing to read it; {fix}")
    if getattr(md, "storage_meta", None) is None:
        md.storage_meta = dcp_meta.StorageMeta()
    return md


class VerifiedReader(FileSystemReader):
    """:class:`FileSystemReader` that verifies every file against ``checksums`` before reading it and
    reads ``.metadata`` through :class:`_MetadataUnpickler`.

    Call :meth:`read_metadata` before ``dcp.load`` (:func:`omnitron.core.checkpoint.dist.read` does): a bad
    ``.metadata`` then raises one CheckpointError here. Inside ``dcp.load`` a failure of this method is
    logged with its traceback and retried (DCP's fallback to per-rank metadata, whose shape changes
    between torch versions) and ends as "metadata is None"; the metadata read first is kept and handed
    to DCP, so its checks never depend on how DCP calls the reader."""

    fix = "load an earlier iteration, or re-save"

    def __init__(self, path: str, checksums: dict[str, str]) -> None:
        super().__init__(path)
        self.dir, self.checksums, self.verified, self.metadata = path, checksums, set(), None
        self.verified_chunks: set = set()
        self.indexes: dict[str, dict] = {}
        self.hashed_bytes = 0
        """Bytes of data chunks hashed (each chunk read whole is verified once; a chunk read through its block
        digests: the blocks read)."""
        self.read_bytes = 0
        """Bytes of tensor data read from the data files: a chunk read whole counts its length per read, a part
        of a chunk (:mod:`~.dist_slices`) the blocks it read."""
        self.blocks: dict[str, tuple | None] = {}

    def _verify(self, name: str) -> None:
        if name in self.verified:
            return
        if not os.path.isfile(f"{self.dir}/{name}"):
            raise CheckpointError(f"{self.dir}/{name} is missing: the checkpoint is incomplete; "
                                  f"{LOAD_EARLIER}")
        if name not in self.checksums:
            raise CheckpointError(f"{self.dir}/{name} has no checksum in metadata.json: the checkpoint is corrupt; "
                                  f"load an earlier iteration, or re-save")
        try:
            integrity.verify(f"{self.dir}/{name}", self.checksums[name])
        except (integrity.IntegrityError, FileNotFoundError) as err:
            raise CheckpointError(f"{err}; {LOAD_EARLIER}") from None
        self.verified.add(name)

    def read_metadata(self, *args, **kwargs):
        """DCP's ``Metadata`` of ``.metadata``, verified and restricted-unpickled once (any ``rank`` argument
        of DCP's fallback is ignored: omnitron writes only the global file)."""
        if self.metadata is None:
            self._verify(".metadata")
            self.metadata = read_dcp_metadata(self.dir, self.fix)
        self.metadata.storage_meta.load_id = self.load_id  # DCP's reset() draws a new id per load
        return self.metadata

    def read_data(self, plan, planner):
        """Read each item of ``plan`` through its saved chunk's verified blocks (only the item's bytes,
        :func:`~.dist_slices.read_box`); a chunk without block digests (older checkpoints) or not a plain archive
        as DCP does, verified first."""
        whole, open_chunks = [], {}
        try:
            for item in plan.items:
                if not self._read_part(item, planner, open_chunks):
                    whole.append(item)
        finally:
            for chunk in open_chunks.values():
                self.read_bytes += chunk.read_bytes
                self.hashed_bytes += chunk.read_bytes  # every block read was hashed
                chunk.close()
        for item in whole:
            info = self.storage_data[item.storage_index]
            self._verify_chunk(info)
            self.read_bytes += info.length
        return super().read_data(LoadPlan(whole), planner)

    def _read_part(self, item, planner, open_chunks: dict) -> bool:
        """Fill ``item``'s target from the blocks of its saved chunk that hold it; False: read it whole."""
        from torch.distributed.checkpoint.planner import LoadItemType

        from omnitron.core.checkpoint.dist_slices import ChunkBytes, read_box

        info = self.storage_data[item.storage_index]
        if item.type != LoadItemType.TENSOR or getattr(info, "transform_descriptors", None):
            return False
        md = self.metadata.state_dict_metadata[item.storage_index.fqn]
        saved = next(c for c in md.chunks if tuple(c.offsets) == tuple(item.storage_index.offset))
        # NOTE: a whole chunk too: verified block by block as it is read, one pass (DCP's read after hashing the
        # chunk read every byte twice)
        blocks = self._block_index(info.relative_path)
        if blocks is None:
            return False
        size, algorithm, digests = blocks
        key = (info.relative_path, info.offset)
        if key not in open_chunks:
            if (info.offset, info.length) not in digests:
                raise CheckpointError(f"{self.dir}/{info.relative_path}: bytes "
                                      f"{info.offset}..{info.offset + info.length}"
                                      f" have no block digests in its chunk index: the checkpoint is corrupt; load an "
                                      f"earlier iteration, or re-save")
            layout, chunk_digests = digests[(info.offset, info.length)]
            open_chunks[key] = ChunkBytes(f"{self.dir}/{info.relative_path}", info.offset, info.length, size,
                                          algorithm, chunk_digests, layout)
        target = planner.resolve_tensor(item).detach()
        direct = target.is_contiguous() and target.device.type == "cpu" and target.dtype == md.properties.dtype
        try:  # straight into the live tensor where it is a contiguous host view of the same dtype
            box = read_box(open_chunks[key], tuple(saved.sizes), md.properties.dtype, tuple(item.storage_offsets),
                           tuple(item.lengths), into=target if direct else None)
        except integrity.IntegrityError as err:
            raise CheckpointError(f"{err}; {LOAD_EARLIER}") from None
        if box is None:
            return False
        if not direct:
            target.copy_(box)
        planner.commit_tensor(item, target)
        return True

    def _block_index(self, name: str):
        """The verified block digests of data file ``name`` (:func:`~.integrity.read_block_index`; None: none)."""
        return self._side_index(name, self.blocks, integrity.read_block_index)

    def _verify_chunk(self, info) -> None:
        """Verify the saved chunk ``info`` (a DCP ``_StorageInfo``: file, offset, length) against its file's chunk
        index, once: a reader hashes only the chunks it reads, not every file it touches. A checkpoint without
        chunk indexes (written before them) has its whole files verified."""
        name, key = info.relative_path, (info.offset, info.length)
        if (name, key) in self.verified_chunks:
            return
        index = self._chunk_index(name)
        if index is None:
            self._verify(name)
            return
        if key not in index:
            raise CheckpointError(f"{self.dir}/{name}: bytes {key[0]}..{sum(key)} have no checksum in its chunk "
                                  f"index: the checkpoint is corrupt; load an earlier iteration, or re-save")
        try:
            integrity.verify_range(f"{self.dir}/{name}", *key, index[key])
        except (integrity.IntegrityError, FileNotFoundError) as err:
            raise CheckpointError(f"{err}; {LOAD_EARLIER}") from None
        self.verified_chunks.add((name, key))
        self.hashed_bytes += key[1]

    def _chunk_index(self, name: str) -> dict | None:
        """The verified chunk index of data file ``name`` (None when metadata.json records none)."""
        return self._side_index(name, self.indexes, integrity.read_chunk_index)

    def _side_index(self, name: str, cache: dict, parse):
        """``parse`` of data file ``name``'s chunk index, verified and parsed once (None: metadata.json records
        no index)."""
        side = name + integrity.CHUNK_INDEX
        if side not in self.checksums:
            return None
        if side not in cache:
            self._verify(side)
            cache[side] = parse(f"{self.dir}/{side}")
        return cache[side]


class ForeignReader(VerifiedReader):
    """A reader of another program's DCP checkpoint (Megatron-Core's ``torch_dist``), which records no
    checksums: nothing is verified, but ``.metadata`` is still read through the restricted unpickler, and
    only tensors are read (DCP's bytes items are ``torch.load``-ed unrestricted: never plan one)."""

    fix = "use a checkpoint from a trusted Megatron run"

    def _verify(self, name: str) -> None:
        """Nothing to verify against."""

    def _verify_chunk(self, info) -> None:
        """No checksums to verify against, but the chunk (a ``torch.save`` archive, which DCP's reader loads whole)
        must hold only stored records of sizes that fit in it (:func:`~.io.zip_record_problem`)."""
        from omnitron.core.checkpoint.dist_slices import FileWindow

        key = (info.relative_path, info.offset, info.length)
        if key in self.verified_chunks:
            return
        with FileWindow(f"{self.dir}/{info.relative_path}", info.offset, info.length) as chunk:
            problem = zip_record_problem(chunk)
        if problem:
            raise CheckpointError(f"{self.dir}/{info.relative_path}: bytes {info.offset}..{info.offset + info.length}"
                                  f" refused: {problem}; {self.fix}")
        self.verified_chunks.add(key)
