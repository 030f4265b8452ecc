"""Peak memory of a real server (``welltempered serve``, default limits) while it handles
the hostile bodies of issue 12, by RSS sampling (tests/security/memory.py).

Every refusal must cost the server at most a constant (the inflation bomb, the
endless chunked .npy, the JSON over the row limit), or, when the refusal comes
only after reading, the limit it enforced; an accepted body at most about twice
its size, plus a constant (predict of 1,000 x 49,152 float32 included, top_k or
.npy answer, and /v2 binary infer of the same); an accepted language-model upload
(issue 13: 1,360 x 49,152 float32 or float16, 255 MiB stored), and a feedback post of
the same, at most 1.5 times the arrays it stores (reads), no constant.
bench/README.md has the figures of this code and of the code before issue 12
("Request bodies: peak memory") and issue 13 ("Language-model uploads").
"""

from __future__ import annotations

import pytest

from tests.security import memory
from tests.service.servers import Server

MiB = memory.MiB
#: Memory a request may take whatever its body: the interpreter's and the
#: allocator's slack, a thread's stack, the answer.
CONSTANT = 64 * MiB
#: The JSON limit of predict on a 10-class model (json_body.json_body_limit at default
#: settings): the most a chunked JSON body is read before its 413.
JSON_LIMIT = 64 * 1024 + 100_000 * (10 * 48 + 64)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("memory")
    with Server(f"sqlite:///{tmp / 'r.sqlite3'}", tmp / "data", fit_executor="thread") as s:
        memory.prepare(s)
        yield s


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.parametrize("make", memory.CASES, ids=lambda f: f.__name__.strip("_"))
def test_peak_memory(server, make):
    case = make()
    row = memory.measure(server, case)
    assert row["status"] == case.status, row
    if case.array_bytes is not None:
        bound = 1.5 * case.array_bytes
    elif case.status in (200, 201):
        bound = 2 * case.body_bytes + CONSTANT
    elif "chunked" in case.name and "JSON" in case.name:
        bound = JSON_LIMIT + CONSTANT
    else:
        bound = CONSTANT
    assert row["growth"] <= bound, (row, bound)
    assert server.proc.poll() is None
