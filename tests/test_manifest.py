"""Manifests: the shipped ones load with the right per-rank spec; every bad value is an error naming file and key."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from prewarm.cli import main
from prewarm.errors import ManifestError
from prewarm.plan import plan
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
    assert (m.backend, m.arch, m.envelope.attention_tp) == ("npu", "Ascend910_9391", 16)
    assert spec["heads"] == 6 and spec["head_k_dim"] == spec["head_v_dim"] == 128
    assert spec["gate_lower_bound"] == -5.0 and spec["decode_batch_buckets"] == [11, 16]
    assert m.kernels[0].kind == "provider" and m.kernels[0].ref == "prewarm_kernels.kda.serving"


def test_kimi_linear_h200_spec():
    spec = load(REPO / "manifests/kimi-linear-h200.toml").spec()
    assert (spec["backend"], spec["arch"], spec["heads"], spec["gate_lower_bound"]) == ("cuda", "sm_90", 32, None)
    assert set(spec) == {"backend", "arch", "device", "heads", "head_k_dim", "head_v_dim", "dtype", "dtypes", "gate_lower_bound",
                         "prefill", "decode_batch_buckets", "draft_widths", "fused_gate", "qk_l2norm", "layers"}
    assert spec["dtype"] == "bfloat16"
    assert spec["dtypes"] == {"activation": ["bfloat16"], "gate": ["bfloat16", "float32"]}
    assert spec["fused_gate"] is True and spec["qk_l2norm"] is True


def test_attention_tp_divides_heads(tmp_path):
    m = load(write(tmp_path, GOOD))
    assert m.envelope.attention_tp == 4 and m.envelope.heads_per_rank == 8 and m.spec()["dtype"] == "bfloat16"


def test_dtypes_default_and_lists(tmp_path):
    """No [dtypes]: bf16 for both roles; gate defaults to the activation dtype(s); each role a string or a list."""
    assert load(write(tmp_path, GOOD)).spec()["dtypes"] == {"activation": ["bfloat16"], "gate": ["bfloat16"]}
    text = GOOD + '[dtypes]\nactivation = ["bfloat16", "float16"]\n'
    spec = load(write(tmp_path, text)).spec()
    assert spec["dtypes"] == {"activation": ["bfloat16", "float16"], "gate": ["bfloat16", "float16"]}
    assert spec["dtype"] == "bfloat16"  # the first activation dtype, for providers that predate "dtypes"
    spec = load(write(tmp_path, GOOD + '[dtypes]\nactivation = "float16"\ngate = "float32"\n')).spec()
    assert spec["dtypes"] == {"activation": ["float16"], "gate": ["float32"]}


@pytest.mark.parametrize(
    "table, key, expected",
    [
        ('activation = "bf16"', "dtypes.activation = 'bf16'", "one of bfloat16, float16, float32"),
        ("activation = []", "dtypes.activation = []", "a non-empty list of distinct ones"),
        ('gate = ["float32", "float32"]', "dtypes.gate = ['float32', 'float32']", "distinct"),
        ("gate = 32", "dtypes.gate = 32", "one of bfloat16, float16, float32"),
        ('beta = "bfloat16"', "dtypes.beta = 'bfloat16'", "no such key here (known: activation, gate)"),
    ],
)
def test_bad_dtypes_name_file_key_value_and_expectation(tmp_path, table, key, expected):
    path = write(tmp_path, GOOD + f"[dtypes]\n{table}\n")
    with pytest.raises(ManifestError) as e:
        load(path)
    msg = str(e.value)
    assert str(path) in msg and key in msg and expected in msg


def test_serving_switches(tmp_path):
    spec = load(write(tmp_path, GOOD.replace("[serving]", "[serving]\nfused_gate = false\nqk_l2norm = false"))).spec()
    assert (spec["fused_gate"], spec["qk_l2norm"]) == (False, False)
    bound = GOOD.replace("head_v_dim = 128", "head_v_dim = 128\ngate_lower_bound = -5.0")
    with pytest.raises(ManifestError, match=r"serving.fused_gate = False: expected true when model.gate_lower_bound"):
        load(write(tmp_path, bound.replace("[serving]", "[serving]\nfused_gate = false")))
    with pytest.raises(ManifestError, match=r"serving.qk_l2norm = 'yes': expected true or false"):
        load(write(tmp_path, GOOD.replace("[serving]", '[serving]\nqk_l2norm = "yes"')))


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


def test_a_record_only_manifest_needs_no_model_and_a_provider_says_what_it_lacks(tmp_path):
    """The core reads [target] and [[kernels]]; the model/serving envelope is the provider's business."""
    (tmp_path / "calls.jsonl").write_text("")
    path = tmp_path / "rec.toml"
    path.write_text('[target]\nbackend = "cuda"\narch = "sm_90"\ndevice = "H200"\n[[kernels]]\nrecord = "calls.jsonl"\n')
    m = load(path)
    assert m.envelope is None and m.spec() == {"backend": "cuda", "arch": "sm_90", "device": "H200"}
    path.write_text('[target]\nbackend = "cuda"\narch = "sm_90"\n[[kernels]]\nprovider = "prewarm_kernels.kda.serving"\n')
    with pytest.raises(ManifestError, match=r"launches\(spec\) failed: ValueError: serving spec is missing \['heads'"):
        plan(load(path))
    path.write_text('[target]\nbackend = "cuda"\narch = "sm_90"\n[serving]\ndraft_widths = [2]\n'
                    '[[kernels]]\nrecord = "calls.jsonl"\n')
    with pytest.raises(ManifestError, match=r"model\.kda_heads is missing"):  # an envelope table needs its model
        load(path)
