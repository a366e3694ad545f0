"""Manifests: the shipped ones load with the right per-rank spec; every bad value is an error naming file and key."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from prewarm.cli import main
from prewarm.errors import ManifestError
from prewarm.manifest import load

REPO = Path(__file__).resolve().parents[1]

GOOD = """
[target]
backend = "cuda"
arch = "sm_90"

[model]
kda_heads = 32
head_k_dim = 128
head_v_dim = 128

[parallel]
tensor_parallel = 8
attention_dp = 2

[serving]
decode_batch_buckets = [1, 2, 4]

[[kernels]]
provider = "some.provider"
"""


def write(tmp_path: Path, text: str, name: str = "m.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_kimi_k3_ascend_spec_has_six_heads_per_rank():
    m = load(REPO / "manifests/kimi-k3-ascend-a3.toml")
    spec = m.spec()
    assert (m.backend, m.arch, m.attention_tp) == ("npu", "Ascend910_9391", 16)
    assert spec["heads"] == 6 and spec["head_k_dim"] == spec["head_v_dim"] == 128
    assert spec["gate_lower_bound"] == -5.0 and spec["decode_batch_buckets"] == [11, 16]
    assert m.kernels[0].kind == "provider" and m.kernels[0].ref == "prewarm_kernels.kda.serving"


def test_kimi_linear_h200_spec():
    spec = load(REPO / "manifests/kimi-linear-h200.toml").spec()
    assert (spec["backend"], spec["arch"], spec["heads"], spec["gate_lower_bound"]) == ("cuda", "sm_90", 32, None)
    assert set(spec) == {"backend", "arch", "heads", "head_k_dim", "head_v_dim", "dtype", "gate_lower_bound",
                         "prefill", "decode_batch_buckets", "draft_widths", "layers"}


def test_attention_tp_divides_heads(tmp_path):
    m = load(write(tmp_path, GOOD))
    assert m.attention_tp == 4 and m.heads_per_rank == 8 and m.spec()["dtype"] == "bfloat16"


def test_heads_that_do_not_divide_name_file_heads_and_tp(tmp_path):
    path = write(tmp_path, GOOD.replace("kda_heads = 32", "kda_heads = 30"))
    with pytest.raises(ManifestError) as e:
        load(path)
    msg = str(e.value)
    assert str(path) in msg and "model.kda_heads = 30" in msg and "attention-TP 4" in msg and "multiple of 4" in msg


@pytest.mark.parametrize(
    "old, new, key, expected",
    [
        ('backend = "cuda"', 'backend = "rocm"', "target.backend = 'rocm'", "one of cuda, npu"),
        ('arch = "sm_90"', 'arch = "hopper"', "target.arch = 'hopper'", "'sm_90'"),
        ("kda_heads = 32", "kda_heads = 0", "model.kda_heads = 0", "a positive integer"),
        ("kda_heads = 32", 'kda_heads = "32"', "model.kda_heads = '32'", "a positive integer"),
        ("[1, 2, 4]", "[1, 2, 2]", "serving.decode_batch_buckets = [1, 2, 2]", "distinct positive integers"),
        ("[1, 2, 4]", "[1, 0]", "serving.decode_batch_buckets = [1, 0]", "distinct positive integers"),
        ("attention_dp = 2", "attention_dp = 3", "parallel.attention_dp = 3", "a divisor of"),
        ("head_v_dim = 128", "head_v_dim = 128\nhead_dim = 64", "model.head_dim = 64", "no such key"),
        ('provider = "some.provider"', 'provider = "some provider"', "kernels[0].provider = 'some provider'",
         "importable module"),
    ],
)
def test_bad_values_name_file_key_value_and_expectation(tmp_path, old, new, key, expected):
    path = write(tmp_path, GOOD.replace(old, new))
    with pytest.raises(ManifestError) as e:
        load(path)
    msg = str(e.value)
    assert str(path) in msg and key in msg and expected in msg


def test_kernel_entry_needs_exactly_one_source(tmp_path):
    path = write(tmp_path, GOOD.replace('provider = "some.provider"', 'provider = "a.b"\nfunction = "a:b"'))
    with pytest.raises(ManifestError, match=r"kernels\[0\].*exactly one"):
        load(path)
    with pytest.raises(ManifestError, match="at least one"):
        load(write(tmp_path, GOOD.split("[[kernels]]")[0]))


def test_function_entry_arguments_are_checked(tmp_path):
    text = GOOD + '\n[[kernels]]\nfunction = "mod:kern"\nargs = { x = { tensor = "bfloat17" } }\n'
    with pytest.raises(ManifestError, match=r"kernels\[1\]\.args\.x = .*bfloat17.*expected \{tensor = DTYPE\}"):
        load(write(tmp_path, text))


def test_record_file_must_exist_and_feeds_the_digest(tmp_path):
    text = GOOD + '\n[[kernels]]\nrecord = "rec.jsonl"\n'
    path = write(tmp_path, text)
    with pytest.raises(ManifestError, match=r"kernels\[1\]\.record = 'rec.jsonl'.*an existing file"):
        load(path)
    (tmp_path / "rec.jsonl").write_text("")
    first = load(path).digest
    assert load(path).digest == first
    (tmp_path / "rec.jsonl").write_text('{"kernel": "a:b", "specialization_data": "{}"}\n')
    assert load(path).digest != first


def test_not_toml_and_missing_file(tmp_path):
    with pytest.raises(ManifestError, match="not valid TOML"):
        load(write(tmp_path, "[target\n"))
    with pytest.raises(ManifestError, match="cannot read manifest"):
        load(tmp_path / "nope.toml")


def test_cli_exit_code_for_a_bad_manifest(tmp_path, capsys):
    path = write(tmp_path, GOOD.replace("kda_heads = 32", "kda_heads = 31"))
    assert main(["plan", str(path)]) == ManifestError.exit_code == 3
    assert "model.kda_heads = 31" in capsys.readouterr().err.replace("\n", "")
