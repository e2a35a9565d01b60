"""How the Makefile's targets pick and order tests. tests/xdist_order.py: loadscope's work units handed out longest
first by the durations table, every test still sent exactly once, unknown tests counted as the table's mean,
`--store-durations` merging into the table. `--megatron-only DIR` (megatron_glue.capture.testing, make
test-mcore012): only the Megatron tests under DIR, the rest as collected."""

import types

import pytest

import xdist_order

pytest.importorskip("xdist")
pytest_plugins = ["pytester"]

COLLECTION = [*(f"tests/a.py::test_{i}" for i in range(5)), "tests/b.py::test_slow",
              "tests/c.py::test_new_0", "tests/c.py::test_new_1", *(f"tests/d.py::Cls::test_{i}" for i in range(3))]
# a: many quick tests; b: one slow one; c: not in the table (mean 103.5 / 9 = 11.5 s a test); d::Cls: a class scope
SECONDS = {**{f"tests/a.py::test_{i}": 0.1 for i in range(5)}, "tests/b.py::test_slow": 100.0,
           **{f"tests/d.py::Cls::test_{i}": 1.0 for i in range(3)}}


class Node:
    shutting_down = False

    def __init__(self, sent, name):
        self.sent, self.gateway = sent, types.SimpleNamespace(id=name)

    def send_runtest_some(self, indices):
        self.sent.append((self, list(indices)))

    def shutdown(self):
        self.shutting_down = True


def config(dist="loadscope"):
    values = {"dist": dist, "tx": ["2*popen"]}
    return types.SimpleNamespace(getvalue=values.__getitem__, option=types.SimpleNamespace(loadscopereorder=True))


def handed_out(scheduler) -> list[str]:
    """Runs the collection through two fake workers, completing tests in the order sent; the scopes in the order
    they were handed out."""
    sent = []
    nodes = [Node(sent, "gw0"), Node(sent, "gw1")]
    for node in nodes:
        scheduler.add_node(node)
    for node in nodes:
        scheduler.add_node_collection(node, COLLECTION)
    scheduler.schedule()
    done = 0
    while done < len(sent):
        node, indices = sent[done]
        done += 1
        for index in indices:
            scheduler.mark_test_complete(node, index)
    indices = [i for _, batch in sent for i in batch]
    assert sorted(indices) == list(range(len(COLLECTION))), "every test sent exactly once"
    assert all(node.shutting_down for node in nodes)
    return [COLLECTION[batch[0]].rsplit("::", 1)[0] for _, batch in sent]


def test_longest_scopes_are_handed_out_first():
    scheduler = xdist_order.make_scheduler(config(), None, seconds=SECONDS)
    assert handed_out(scheduler) == ["tests/b.py", "tests/c.py", "tests/d.py::Cls", "tests/a.py"]


def test_xdist_alone_hands_out_the_most_tests_first():
    """What the table changes: loadscope's own order (most tests first) starts the slow module last."""
    from xdist.scheduler import LoadScopeScheduling

    assert handed_out(LoadScopeScheduling(config(), None)) == ["tests/a.py", "tests/d.py::Cls", "tests/c.py",
                                                               "tests/b.py"]


def test_without_a_table_scopes_go_by_their_test_count():
    assert handed_out(xdist_order.make_scheduler(config(), None, seconds={})) == [
        "tests/a.py", "tests/d.py::Cls", "tests/c.py", "tests/b.py"]


def test_other_dist_modes_keep_xdists_scheduler():
    assert xdist_order.make_scheduler(config("load"), None) is None


def test_stored_durations_are_merged_into_the_table(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    path = tmp_path / "durations.json"
    path.write_text('{"tests/a.py::test_0": 5.0, "tests/gone.py::test": 2.0}\n')
    recorder = xdist_order.DurationRecorder(path)
    for when, seconds in (("setup", 0.25), ("call", 1.5), ("teardown", 0.125)):
        recorder.pytest_runtest_logreport(types.SimpleNamespace(nodeid="tests/a.py::test_0", when=when,
                                                                duration=seconds))
    recorder.pytest_runtest_logreport(types.SimpleNamespace(nodeid="tests/b.py::test_slow", when="call", duration=3.0))
    recorder.pytest_sessionfinish(None)
    assert xdist_order.stored_durations(path) == {"tests/a.py::test_0": 1.88, "tests/b.py::test_slow": 3.0,
                                                  "tests/gone.py::test": 2.0}


def test_the_checked_in_table_names_collected_tests():
    """The table is keyed by pytest node ids (a typo'd or path-less key would order nothing)."""
    table = xdist_order.stored_durations()
    assert table and all(key.startswith("tests/") and "::" in key for key in table)
    assert all(isinstance(s, float | int) and s >= 0 for s in table.values())


def test_megatron_only_limits_the_folder_it_names(pytester):
    pytester.makepyfile(**{"passes/test_p": "def test_plain(): pass\ndef test_megatron_model(): pass\n",
                           "other/test_o": "def test_plain(): pass\n"})
    result = pytester.runpytest_inprocess("-p", "megatron_glue.capture.testing", "--megatron-only=passes", "-v")
    result.assert_outcomes(passed=2, deselected=1)
    result.stdout.fnmatch_lines(["other/test_o.py::test_plain PASSED*", "passes/test_p.py::test_megatron_model PASSED*"])
    result.stdout.no_fnmatch_line("passes/test_p.py::test_plain *")


def test_megatron_only_names_a_missing_folder(pytester):
    pytester.makepyfile(**{"passes/test_p": "def test_plain(): pass\n"})
    result = pytester.runpytest_inprocess("-p", "megatron_glue.capture.testing", "--megatron-only=pases")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: --megatron-only {pytester.path / 'pases'}: not a folder (give the folder "
                                 "whose tests it limits to those using megatron-core, e.g. tests/passes)"])
