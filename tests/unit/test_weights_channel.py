"""The filesystem weight channel: streamed safetensors files, sparse deltas, chains, fallbacks.

Weights are fp32 master copies moved as AdamW moves them at a small learning rate (every
element by about lr), published in bf16, as a bf16 trainer does."""
from __future__ import annotations

import json

import pytest
import torch
import xxhash
from safetensors.torch import load_file

from astraflow.weights import delta as deltas
from astraflow.weights.manifest import DELTA_FILE, FULL_FILE, read_manifest, version_dirs
from astraflow.weights.publisher import Publisher
from astraflow.weights.reader import WeightReader, load_version
from astraflow.weights.tensors import xxh3
from astraflow.weights.writer import write_file


def master(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(300, 64, generator=g) * 0.02,
            "layer.0.q.weight": torch.randn(64, 64, generator=g) * 0.02,
            "layer.0.q.bias": torch.zeros(64), "norm.weight": torch.ones(64)}


def adam_like_step(state: dict[str, torch.Tensor], lr: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in state.values():
        t.add_(lr * torch.sign(torch.randn(t.shape, generator=g)))


def published(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: xxh3(t.to(torch.bfloat16)) for n, t in state.items()}


def held(reader: WeightReader) -> dict[str, str]:
    return {n: xxh3(t) for n, t in reader.state.items()}


def test_streamed_file_is_safetensors_with_checksums_computed_while_writing(tmp_path):
    tensors = {"b": torch.randn(5, 3).to(torch.bfloat16), "a": torch.arange(7, dtype=torch.int32),
               "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4)}
    file_sum, sums = write_file(tmp_path / "x.safetensors", tensors, {"version": "3"})
    back = load_file(str(tmp_path / "x.safetensors"))
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name].view(-1).view(torch.uint8),
                                                           t.view(-1).view(torch.uint8))
        assert sums[name] == xxh3(back[name])
    assert file_sum == xxhash.xxh3_64_hexdigest((tmp_path / "x.safetensors").read_bytes())
    header_len = int.from_bytes((tmp_path / "x.safetensors").read_bytes()[:8], "little")
    assert header_len % 8 == 0


def test_fifty_versions_through_deltas_are_bit_equal_and_small(tmp_path):
    """A worker one version behind applies each delta; after 50 versions it holds exactly the
    trainer's bf16 weights, and a delta at lr 1e-6 is a few percent of the full version (a
changed bf16 element costs about 3 bytes: a one-byte gap and its value)."""
    state = master()
    pub = Publisher(tmp_path / "weights", "policy", tmp_path, torch.bfloat16, full_every=100)
    reader = WeightReader(tmp_path / "weights" / "policy")
    kinds = []
    for v in range(1, 51):
        adam_like_step(state, 1e-6, v)
        p = pub.publish(state, v)
        kinds.append(p.manifest.kind)
        update = reader.advance(tmp_path / "weights" / "policy" / p.manifest.name)
        assert update.version == v and update.how == ("full" if v == 1 else "delta")
        assert held(reader) == published(state)
        if v > 1:
            assert 0 < p.manifest.changed < 0.05 * p.manifest.elements
            assert p.bytes_written < 3.1 * p.manifest.changed and p.bytes_written < 0.1 * p.full_bytes
    assert kinds == ["full"] + ["delta"] * 49
    assert (tmp_path / "weights" / "policy" / "v1" / FULL_FILE).exists()
    assert (tmp_path / "weights" / "policy" / "v2" / DELTA_FILE).exists()


def test_full_every_k_and_a_large_delta_is_published_full(tmp_path):
    state = master()
    pub = Publisher(tmp_path / "w", "policy", tmp_path, torch.bfloat16, full_every=3)
    kinds = []
    for v in range(1, 8):
        adam_like_step(state, 1e-6, v)
        kinds.append(pub.publish(state, v).manifest.kind)
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta", "full"]
    adam_like_step(state, 1e-2, 99)  # every element moves: the delta would be 3x the full version
    pub.full_every = 100
    assert pub.publish(state, 8).manifest.kind == "full"
    adam_like_step(state, 1e-2, 100)  # again: counted, not made, published full
    p = pub.publish(state, 9)
    assert p.full and p.delta_bytes == -1 and p.manifest.changed > 0.9 * p.manifest.elements
    adam_like_step(state, 1e-6, 101)  # small again: made in a second pass and published as a delta
    p = pub.publish(state, 10)
    assert p.manifest.kind == "delta" and 0 < p.delta_bytes < 0.1 * p.full_bytes
    reader = WeightReader(tmp_path / "w" / "policy")
    assert reader.advance(tmp_path / "w" / "policy" / "v10").version == 10 and held(reader) == published(state)


def test_a_delta_past_its_limit_is_not_encoded_but_its_changes_are_counted():
    old = master()
    new = {n: t.clone() for n, t in old.items()}
    adam_like_step(new, 1e-2, 1)  # every element moves
    full, changed = deltas.make(old, new)
    assert changed == sum(t.numel() for t in new.values()) and deltas.payload_bytes(full) > 4 * changed
    assert deltas.make(old, new, limit=deltas.payload_bytes(full) // 4) == (None, changed)


def test_chain_catch_up_takes_the_cheaper_way(tmp_path):
    """A worker several versions behind applies the chain of deltas (through a full version,
    which holds its delta too) when that moves fewer bytes than the newest full version and
    the deltas after it, and loads that full version when the deltas are large; a worker with
    nothing loads the full version."""
    state = master()
    policy_dir = tmp_path / "w" / "policy"
    pub = Publisher(tmp_path / "w", "policy", tmp_path, torch.bfloat16, full_every=4)
    behind, far_behind = WeightReader(policy_dir), WeightReader(policy_dir)
    kinds = []
    for v in range(1, 8):
        adam_like_step(state, 1e-6, v)
        kinds.append(pub.publish(state, v).manifest.kind)
        if v == 2:
            behind.advance(policy_dir / "v2")
            far_behind.advance(policy_dir / "v2")
    assert kinds == ["full", "delta", "delta", "delta", "full", "delta", "delta"]
    assert read_manifest(policy_dir / "v5").base == "v4" and (policy_dir / "v5" / DELTA_FILE).exists()
    update = behind.advance(policy_dir / "v7")
    assert (update.how, update.version) == ("delta", 7) and held(behind) == published(state)
    assert update.bytes_read == sum((policy_dir / f"v{v}" / DELTA_FILE).stat().st_size for v in range(3, 8))
    fresh = WeightReader(policy_dir)
    update = fresh.advance(policy_dir / "v7")
    assert update.how == "full" and held(fresh) == published(state)
    # large deltas (~37% of the full version each): five of them cost more than v9 and two deltas
    for v in range(8, 12):
        adam_like_step(state, 1e-5, v)
        pub.publish(state, v)
    assert read_manifest(policy_dir / "v9").full
    update = far_behind.advance(policy_dir / "v11")
    assert update.how == "full" and held(far_behind) == published(state)
    assert update.bytes_read == ((policy_dir / "v9" / FULL_FILE).stat().st_size
                                 + sum((policy_dir / f"v{v}" / DELTA_FILE).stat().st_size for v in (10, 11)))


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_a_damaged_delta_is_detected_and_the_worker_falls_back_to_the_last_full(tmp_path, damage):
    state = master()
    policy_dir = tmp_path / "w" / "policy"
    pub = Publisher(tmp_path / "w", "policy", tmp_path, torch.bfloat16, full_every=100)
    reader = WeightReader(policy_dir)
    snapshots = {}
    for v in range(1, 5):
        adam_like_step(state, 1e-6, v)
        pub.publish(state, v)
        snapshots[v] = published(state)
    reader.advance(policy_dir / "v2")
    victim = policy_dir / "v3" / DELTA_FILE
    data = victim.read_bytes()
    if damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        victim.write_bytes(data[:-3] + bytes([data[-3] ^ 0x10]) + data[-2:])
    else:
        victim.unlink()
    update = reader.advance(policy_dir / "v4")
    assert (update.how, update.version, update.name) == ("fallback", 1, "v1")  # v3 is on every way to v4
    assert held(reader) == snapshots[1]
    assert "v3" in reader.bad
    # the next full version brings it back
    pub.full_every = 1
    adam_like_step(state, 1e-6, 5)
    pub.publish(state, 5)
    assert reader.advance(policy_dir / "v5").version == 5 and held(reader) == published(state)


def test_a_replayed_version_gets_its_own_directory_and_load_version_reads_any(tmp_path):
    state = master()
    policy_dir = tmp_path / "w" / "policy"
    pub = Publisher(tmp_path / "w", "policy", tmp_path, torch.bfloat16, full_every=100)
    for v in range(1, 4):
        adam_like_step(state, 1e-6, v)
        pub.publish(state, v)
    v3 = published(state)
    restarted = Publisher(tmp_path / "w", "policy", tmp_path, torch.bfloat16, full_every=100)
    adam_like_step(state, 1e-6, 33)  # the replayed step need not give the same weights
    p = restarted.publish(state, 3)
    assert p.manifest.name == "v3-1" and p.full  # a fresh publisher starts with a full version
    assert [d.name for d in version_dirs(policy_dir)] == ["v1", "v2", "v3", "v3-1"]
    assert read_manifest(policy_dir / "v3").base == "v2"  # the first v3 is left as it was
    weights, manifest = load_version(tmp_path / "w", "policy", 3)
    assert manifest.name == "v3-1" and {n: xxh3(t) for n, t in weights.items()} == published(state)
    reader = WeightReader(policy_dir)
    reader.advance(policy_dir / "v3")
    assert held(reader) == v3


def test_tied_weights_are_published_once(tmp_path):
    emb = torch.randn(10, 4)
    pub = Publisher(tmp_path / "w", "policy", tmp_path, None)
    p = pub.publish({"model.embed_tokens.weight": emb, "lm_head.weight": emb, "x": torch.ones(2)}, 1)
    assert set(p.manifest.tensors) == {"model.embed_tokens.weight", "x"}
    manifest = json.loads((tmp_path / "w" / "policy" / "v1" / "manifest.json").read_text())
    assert manifest["kind"] == "full" and manifest["dtype"] == "float32"
