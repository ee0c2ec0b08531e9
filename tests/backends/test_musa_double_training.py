"""The MUSA double is a device, not a label: its tensors are ``torch.device("musa")`` tensors on the sim device,
its memory statistics are that device's allocator and its RNG the device's generator (checked against host
torch here), and the engine trains on it (tp 2, ``mccl`` between two processes) with the losses of cpu.
Results here are MUSA-double results, never MUSA."""
from __future__ import annotations

import os

import pytest
import torch

import strict_group_cases
from omnitron.testing import musa_double
from omnitron.testing.distributed import REFERENCE_KERNELS, run_distributed
from omnitron.testing.musa_double import requires_double
from omnitron.testing.nccl_groups import replay
from omnitron.testing.sim import requires_sim

ITERS = 4


@requires_double()
def test_memory_statistics_are_the_device_allocators():
    """Allocating a tensor on musa raises memory_allocated by its bytes rounded up to the caching allocator's
    512-byte blocks, as CUDA's and torch_musa's round (a host tensor by nothing);
    freeing it gives them back; the peak remembers; the keys are torch_musa's."""
    with musa_double.installed():
        be = musa_double.MUSADoubleBackend()
        n = int(torch.randint(100, 5000, (1,)))  # fresh size: a hard-coded figure could not fail
        be.reset_peak_memory_stats()
        base = torch.musa.memory_allocated()
        host = torch.empty(n, 3, dtype=torch.float64)
        assert torch.musa.memory_allocated() == base, "a host tensor is not device memory"
        x = torch.empty(n, 3, dtype=torch.float64, device="musa")
        assert x.device == torch.device("musa", 0) and x.is_musa
        assert x.nbytes == host.nbytes
        assert torch.musa.memory_allocated() - base == -(-x.nbytes // 512) * 512
        assert be.memory_stats()["allocated"] == torch.musa.memory_allocated()
        free, total = torch.musa.mem_get_info()
        assert total - free == torch.musa.memory_allocated()
        del x
        stats = torch.musa.memory_stats()
        assert stats["allocated_bytes.all.current"] == base
        assert stats["allocated_bytes.all.peak"] - base >= 24 * n
        assert torch.musa.max_memory_allocated() == stats["allocated_bytes.all.peak"]


@requires_double()
def test_device_rng_is_the_devices_own():
    """Device draws (dropout included) leave the host generator alone; a seeded device stream is the same
    Mersenne Twister stream host torch draws from that seed; the device state restores its stream."""
    with musa_double.installed():
        be = musa_double.MUSADoubleBackend()
        seed = int(torch.randint(0, 2**31, (1,)))
        host_state = torch.get_rng_state()
        be.manual_seed(seed)
        drawn = torch.rand(16, device="musa")
        torch.nn.functional.dropout(torch.ones(64, device="musa"), 0.5)
        assert torch.equal(torch.get_rng_state(), host_state), "a device draw advanced the host RNG"
        assert torch.equal(drawn.cpu(), torch.rand(16, generator=torch.Generator().manual_seed(seed)))
        state = torch.musa.get_rng_state()
        a = torch.randn(8, device="musa").cpu()
        torch.musa.set_rng_state(state)
        assert torch.equal(torch.randn(8, device="musa").cpu(), a)
        assert not torch.equal(state, torch.get_rng_state()), "the device state is not the host state"


def _args(root: str) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "96",
            "--num-workers", "0", "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "2",
            "--no-tensorboard", "--data-cache-path", os.path.join(root, "cache"), "--lr", "1e-2", "--train-iters",
            str(ITERS), "--tensor-model-parallel-size", "2", "--clip-grad", "1.0",
            # dropout draws from the device generator on musa and from the host one on cpu: different masks
            "--hidden-dropout", "0", "--attention-dropout", "0"]


def train_recording_placement(root: str) -> dict:
    """Train on this worker's backend; also where the parameters, gradients and batches lived at each step."""
    import torch.distributed as dist

    import omnitron.core.training.loop as loop
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings

    torch.set_num_threads(1)
    be = get_backend()
    seen, step = set(), loop.train_step

    def recording(c, data_iterator, *args, **kwargs):
        def batches():
            for batch in data_iterator:
                seen.update(("batch", v.device.type) for v in batch.values() if isinstance(v, torch.Tensor))
                yield batch

        out = step(c, batches(), *args, **kwargs)
        for m in c.modules:
            for p in m.parameters():
                grad = getattr(p, "main_grad", None)
                grad = p.grad if grad is None else grad
                seen.update({("param", p.device.type)} | ({("grad", grad.device.type)} if grad is not None else set()))
        return out

    loop.train_step = recording
    try:
        res = loop.train(parse_settings(_args(os.path.join(root, be.name)), dist.get_world_size()), be)
    finally:
        loop.train_step = step
    return {"losses": res["losses"], "seen": seen, "peak": be.memory_stats()["peak_allocated"],
            "dist": dist.get_backend()}


@requires_sim()  # the double runs in the spawned workers: only the build matters
@pytest.mark.multiprocess
def test_training_on_the_musa_double_matches_cpu(tmp_path):
    env = {**REFERENCE_KERNELS, "OMNITRON_EXTRA_BACKENDS": musa_double.TARGET}
    musa = run_distributed(train_recording_placement, 2, str(tmp_path), backend="musa-double", env=env)
    cpu = run_distributed(train_recording_placement, 2, str(tmp_path), backend="cpu", env=env)
    for r in musa:
        assert r["dist"] == "mccl" and r["peak"] > 0
        assert {kind for kind, _ in r["seen"]} == {"batch", "param", "grad"}
        assert {dev for _, dev in r["seen"]} == {"musa"}, f"host tensors in a musa run: {sorted(r['seen'])}"
    assert {dev for _, dev in cpu[0]["seen"]} == {"cpu"}
    # The same CPU kernels run on the same fp32 data through gloo in the same order (mccl is gloo on host
    # copies). What may round differently: attention, which runs torch's fused CPU kernel on cpu and SDPA's
    # math path on an out-of-tree device (both fp32-accumulated softmax(q k^T) v over <= 16 keys: a few
    # u = 6e-8 relative per activation, attenuated through the residual stream), and the reported loss, an
    # fp32 sum of n = 32 per-token losses whose order may change: at most (n - 1) u ~ 1.9e-6 relative.
    # REL = 2e-6 covers both; a tensor on the wrong device, a lost update or another data order moves the
    # loss by 1e-3 or more.
    rel = 2e-6
    assert len(cpu[0]["losses"]) == ITERS
    for m, c in zip(musa, cpu):
        assert m["losses"].keys() == c["losses"].keys()
        for it, loss in c["losses"].items():
            assert abs(m["losses"][it] - loss) <= rel * abs(loss), (it, m["losses"][it], loss)


@requires_sim()
@pytest.mark.multiprocess
def test_strict_batches_on_the_musa_double_are_one_group_each():
    """MCCL is a port of NCCL: the MUSA backend posts each strict point-to-point batch as one group
    (``p2p_groups_in_order``), which the replay model of NCCL's group order completes and the double's ``mccl``
    (simccl, which fails a pair whose batches wait for each other: csrc/sim/group_order.cpp) runs; the host
    transports' shape would be reported there. Each buffer holds exactly what the peer sent into it (a copy)."""
    env = {"OMNITRON_EXTRA_BACKENDS": musa_double.TARGET, "OMNITRON_STRICT_COLLECTIVES": "1"}
    out = run_distributed(strict_group_cases.symmetric, 2, None, backend="musa-double", env=env, timeout_s=120)
    assert replay([o["groups"] for o in out]) is None, [o["groups"] for o in out]
    for me in (0, 1):
        assert out[me]["got"] == [[100.0 * (1 - me) + 10 * i + s] for i in range(3) for s in (0, 1)], out[me]["got"]
