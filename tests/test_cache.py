"""The persistent compile cache: a miss compiles and stores, a second compile of the same graph loads every step,
a corrupt or mismatched entry is ignored and rebuilt, and cache=False reads and writes nothing."""

import logging

import pytest
import torch

from npu_compile import cache
from npu_compile.debug.report import collect


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.nn.functional.gelu(self.fc(self.norm(x))) + x


def step(options, seed=0):
    torch.manual_seed(seed)
    model = Block()
    x = torch.randn(4, 16, requires_grad=True)
    compiled = torch.compile(model, backend="ascend", options=options)
    with collect() as reports:
        out = compiled(x)
        out.sum().backward()
    return out.detach(), [p.grad for p in model.parameters()], reports[0]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def entries(folder):
    return sorted(folder.rglob("*.bin"))


def test_second_compile_loads_every_step_and_equals_the_first(cache_dir):
    out1, grads1, r1 = step({"cache": True})
    assert r1.cache == {"partition": "miss", "forward": "miss", "backward": "miss"}
    assert len(entries(cache_dir)) == 3
    torch._dynamo.reset()  # a restarted process: Dynamo's in-memory code cache gone, the files kept
    out2, grads2, r2 = step({"cache": True})
    assert r2.cache == {"partition": "hit", "forward": "hit", "backward": "hit"}
    assert torch.equal(out1, out2) and all(torch.equal(a, b) for a, b in zip(grads1, grads2))
    assert (r2.fusions, r2.lowered_ops, r2.graphs) == (r1.fusions, r1.lowered_ops, r1.graphs)


def test_other_options_are_another_key(cache_dir):
    step({"cache": True})
    torch._dynamo.reset()
    _, _, r = step({"cache": True, "fusions": []})
    assert r.cache["partition"] == "miss"


def test_corrupt_entry_is_ignored_and_rebuilt(cache_dir, caplog):
    out1, _, _ = step({"cache": True})
    for path in entries(cache_dir):
        data = path.read_bytes()
        path.write_bytes(data[:-10] + b"x" * 10)  # the payload no longer matches its checksum
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="npu_compile"):
        out2, _, r = step({"cache": True})
    assert r.cache == {"partition": "rebuilt", "forward": "rebuilt", "backward": "rebuilt"}
    assert "checksum mismatch" in caplog.text
    assert torch.equal(out1, out2)
    torch._dynamo.reset()
    _, _, r3 = step({"cache": True})  # rebuilt entries are good again
    assert set(r3.cache.values()) == {"hit"}


def test_entry_of_another_key_is_not_trusted(cache_dir):
    step({"cache": True})
    paths = entries(cache_dir)
    blobs = [p.read_bytes() for p in paths]
    for p, b in zip(paths, blobs[1:] + blobs[:1]):  # every entry holds another one's content
        p.write_bytes(b)
    torch._dynamo.reset()
    out, _, r = step({"cache": True})
    assert "hit" not in r.cache.values()
    assert torch.isfinite(out).all()


def test_cache_off_reads_and_writes_nothing(cache_dir):
    _, _, r = step({"cache": False})
    assert set(r.cache.values()) == {"off"}
    assert not entries(cache_dir)
