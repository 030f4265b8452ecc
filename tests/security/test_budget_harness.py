"""Every operation of a real server against hostile requests made from its own declared
budget (``x-budget`` in /openapi.json; service.server.budget): the harness that makes
the next hole visible. The cases are built in budget_cases.py; tests/security/README.md
lists them.

One ``welltempered serve`` process (SQLite, auth on, limits of a few MiB:
budget_cases.SETTINGS), a model of K = 10 classes whose class names are the longest the
API accepts, a fitted and aliased version, a dataset, a second model for the routes
that change or delete things. For every operation of the document: a body of its
limit + 1 declared and sent, 1 GiB declared and 1 MiB sent, its limit + 1 chunked,
bombs (gzip, deflate) inflating to 8 times its decoded limit where it takes encodings
and a gzip body where it does not, ``br``, its valid body under the wrong Content-Type,
each string of its JSON body filling the body, each path and query parameter of
60,000 characters (the URL's limit is 65,535 bytes) and header parameter of 1 MiB, and
for the scores routes their largest declared shapes (rows at the row limit, ``top_k`` =
K, every output, the names); once, before any route, a request line and a header value
of 32 MiB.

Each request must get an answer below 500 (the expected status where there is one),
of at most its ``answer_bytes``, and cost the server at most ``2 * carried +
CONSTANT`` of anonymous RSS at its peak, ``carried`` being the bytes the request
legitimately carries once decoded, capped by its route's limit.

CONSTANT is 64 MiB: what a request may cost whatever it carries. Measured on this
code (the table the test prints), the requests that carry nothing grow the server by
0-3 MiB; the largest growths past twice what a request carries are a 5 MB list of
models (+15 MiB: the rows, their pydantic models and orjson's buffer) and a 3.4 MiB
.npz upload (+13.5 MiB, 6.7 MiB past twice its size: zipfile's and numpy's buffers,
the validated copy of the labels, the store's hash); an accepted predict or infer
with the names of a 1 MB answer, under 1 MiB. Beyond these, a request may meet one
of the process's first costs (ONNX Runtime's arena for a new batch size, a glibc
arena of a new thread: 64 MiB of address space, a few MiB touched). 64 MiB, as in
test_memory.py, is room for those on another machine, while the costs of holes stay
far above it (a 1 GiB inflation; a 32 MiB header, +95 to +122 MiB).
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.server import budget
from tests.security import budget_cases as bc
from tests.service.helpers import make_settings

MiB = bc.MiB
#: What a request may cost the server whatever it carries (module docstring).
CONSTANT = 64 * MiB


def bound(case: bc.Case) -> int:
    return 2 * case.carried + CONSTANT


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("budget-harness")
    with bc.serve(tmp) as server:
        target, victim = bc.prepare(server)
        with server.client() as c:
            doc = c.get("/openapi.json").json()
        yield server, doc, target, victim


@pytest.mark.process
def test_every_operation_has_a_budget_and_a_harness_entry(served):
    _, doc, _, _ = served
    ops = bc.operations(doc)
    unbudgeted = sorted(op["op"] for op in ops if op["x-budget"] is None)
    assert not unbudgeted, f"operations without an x-budget: {unbudgeted}"
    documented = {op["op"] for op in ops}
    new = sorted(documented - set(bc.ROUTES))
    gone = sorted(set(bc.ROUTES) - documented)
    assert not new, f"operations the harness does not know (add them to ROUTES): {new}"
    assert not gone, f"operations of ROUTES no longer in /openapi.json: {gone}"


@pytest.fixture(scope="module")
def results(served) -> list[bc.Row]:
    """Every case of every operation, run once against the server (and the table)."""
    server, doc, target, victim = served
    rows = []
    for case in bc.all_cases(doc, target, victim, bc.SETTINGS):
        rows.append(bc.run(server, case))
        assert server.proc.poll() is None, f"the server died at {case.op} | {case.name}"
    print()
    print(bc.table(rows, bound))
    assert {row.case.op for row in rows} == set(bc.ROUTES)
    return rows


def _bodyless(budgets: dict, row: bc.Row) -> bool:
    """A body sent to an operation that takes none (its budget's body_bytes is 0)."""
    return row.case.over_budget and budgets[row.case.op]["body_bytes"] == 0


def _failures(rows: list[bc.Row], budgets: dict, statuses: bool) -> list[str]:
    failures = []
    for row in rows:
        case, reply, limit = row.case, row.reply, budgets[row.case.op]["answer_bytes"]
        problems = []
        if reply.status == 0 or reply.status >= 500:
            problems.append(f"status {reply.status}")
        elif statuses and case.expect is not None and reply.status not in case.expect:
            problems.append(f"status {reply.status}, expected {sorted(case.expect)}")
        if reply.answer_bytes > limit:
            problems.append(f"answer {reply.answer_bytes:,} bytes > {limit:,}")
        if row.growth > bound(case):
            problems.append(f"RSS +{row.growth / MiB:.0f} MiB > {bound(case) / MiB:.0f} MiB")
        if problems:
            failures.append(f"{case.op} | {case.name}: {'; '.join(problems)} "
                            f"({reply.head[:200]!r})")
    return failures


@pytest.mark.process
@pytest.mark.slow
def test_hostile_requests_stay_within_the_declared_budgets(served, results):
    """No 5xx, no answer over its bound, no memory over its bound; the refusal expected
    (413, 415, 400, 422) wherever the operation reads a body."""
    budgets = {op["op"]: op["x-budget"] for op in bc.operations(served[1])}
    rows = [row for row in results if not _bodyless(budgets, row)]
    failures = _failures(rows, budgets, statuses=True)
    failures += _failures([r for r in results if _bodyless(budgets, r)], budgets, False)
    assert not failures, "\n".join(failures)


@pytest.mark.process
@pytest.mark.slow
def test_an_operation_without_a_body_refuses_one(served, results):
    """A body (declared, chunked, or an encoding) sent to an operation whose budget
    allows none: 413 or 415, as the budget says, and the handler does not run."""
    budgets = {op["op"]: op["x-budget"] for op in bc.operations(served[1])}
    rows = [row for row in results if _bodyless(budgets, row)]
    assert rows
    wrong = [f"{r.case.op} | {r.case.name}: {r.reply.status}" for r in rows
             if r.reply.status not in r.case.expect]
    assert not wrong, f"{len(wrong)} of {len(rows)} answered:\n" + "\n".join(wrong)


def test_an_app_with_a_handler_without_its_budget_is_not_built(tmp_path, monkeypatch):
    """Delete each route's budget in turn: building the app fails, naming that route.
    (The handlers an app makes for itself when it is built, the docs pages and
    /openapi.json, are declared by the code that makes them: each build declares anew.)"""
    settings = make_settings(f"sqlite:///{tmp_path / 'r.sqlite3'}", tmp_path)

    def handlers() -> dict:
        found = {}
        for route in budget.flatten(create_app(settings).routes):
            endpoint = getattr(route, "endpoint", None)
            if endpoint is not None:
                assert hasattr(endpoint, "__budget__"), route.path
                found.setdefault(endpoint, []).append(route)
        return found

    first, second = handlers(), handlers()
    endpoints = {e: routes for e, routes in first.items() if e in second}
    assert len(endpoints) >= 30
    for endpoint, routes in endpoints.items():
        with monkeypatch.context() as m:
            m.delattr(endpoint, "__budget__")
            with pytest.raises(budget.MissingBudget) as refused:
                create_app(settings)
        for route in routes:
            assert route.path in str(refused.value), (route.path, refused.value)
    with TestClient(create_app(settings)):  # and every budget is back
        pass
