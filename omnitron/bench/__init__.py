"""``omnitron bench``: one benchmark suite across hardware, every report in one JSON schema (:mod:`.report`).

One module per question: :mod:`.gemm` (TFLOP/s per dtype), :mod:`.comm` (collective bus bandwidth),
:mod:`.memory` (copy / read / write bandwidth), :mod:`.attention` (SDPA against the reference),
:mod:`.train` (a named config's step: tokens/s, TFLOP/s, MFU, memory, time split), the existing kernel
benchmark (``omnitron.kernels.benchmark``), :mod:`.compare` (tables and plots of any number of
reports) and :mod:`.suite` (all of them into one folder).
"""
