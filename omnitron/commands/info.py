"""``omnitron info``: detected backends with reasons, capabilities, kernel table, versions."""
from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("info", help="show backends, capabilities and the resolved kernel table")
    p.add_argument("--backend", default=None, help="backend to describe (default: $OMNITRON_BACKEND or auto)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from omnitron.backends.registry import BackendUnavailableError, get_backend, probe_all

    print("backends:")
    report = probe_all()
    width = max(map(len, report), default=0)  # a plug-in's name may be longer than the built-ins'
    for name, (ok, why) in report.items():
        print(f"  {name:{width}s} {'usable' if ok else 'not usable':10s} {why}")
    try:
        backend = get_backend(args.backend)
    except BackendUnavailableError as err:
        print(f"\nerror: {err}")
        return 1
    caps = backend.capabilities()
    print(f"\nselected: {backend.label()} (device type {backend.device_type!r}, "
          f"collectives {backend.dist_backend!r}, "
          f"{backend.device_count()} device(s), current {backend.current_device()})")
    print("capabilities:")
    for field, value in caps.__dict__.items():
        print(f"  {field:16s} {value}")
    print("kernels (op -> implementation tried first):")
    from omnitron.kernels.registry import KernelContractError

    try:
        table = backend.kernels.table()
    except KernelContractError as err:
        print(f"\nerror: {err}")
        return 1
    for op, impl in table.items():
        print(f"  {op:24s} {impl}")
    describe = getattr(backend.fp8, "describe", None)
    print(describe() if describe else f"fp8 gemm path: {backend.fp8.path}")
    coll = backend.collectives
    print(f"fp8 tensors in collectives: {'native float8' if coll.fp8_native else 'uint8 views, reductions in fp32'}")
    from omnitron.backends.collectives import strict_enabled

    print(f"strict collectives: {'on' if strict_enabled() else 'off'} (OMNITRON_STRICT_COLLECTIVES); "
          f"flight recorder: last {coll.flight_recorder_size()} calls per rank")
    print("versions:", ", ".join(f"{k} {v}" for k, v in backend.versions().items()))
    import torch

    from omnitron.backends.torch_range import describe as describe_torch

    print(describe_torch(torch.__version__))
    return 0
