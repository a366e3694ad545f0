"""Manifests: the core ([target], [[kernels]]) is checked at load; [spec] is the providers' business, checked by
the provider as it plans (the shipped KDA ones through prewarm_kernels.spec), and every bad value is an error naming
file, key, value and expectation."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from prewarm.cli import main
from prewarm.errors import ManifestError
from prewarm.planning.manifest import load
from prewarm.planning.plan import plan
from prewarm_kernels.spec import read_kda

REPO = Path(__file__).resolve().parents[1]

GOOD = """
[target]
backend = "cuda"
arch = "sm_90"

[spec.model]
kda_heads = 32
head_k_dim = 128
head_v_dim = 128

[spec.parallel]
tensor_parallel = 8
attention_dp = 2

[spec.serving]
decode_batch_buckets = [1, 2, 4]

[[kernels]]
provider = "prewarm_kernels.kda.serving"
"""


def write(tmp_path: Path, text: str, name: str = "m.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def spec_error(path: Path) -> str:
    """The planner's error for a manifest whose [spec] its provider refuses (the provider checks as it plans)."""
    with pytest.raises(ManifestError) as e:
        plan(load(path))
    return str(e.value)


def test_kimi_k3_ascend_spec_has_six_heads_per_rank():
    m = load(REPO / "manifests/kimi-k3-ascend-a3.toml")
    spec = read_kda(m.spec())
    assert (spec["backend"], spec["arch"], spec["attention_tp"]) == ("npu", "Ascend910_9391", 16)
    assert spec["heads"] == 6 and spec["head_k_dim"] == spec["head_v_dim"] == 128
    assert spec["gate_lower_bound"] == -5.0 and spec["decode_batch_buckets"] == [11, 16]
    assert m.kernels[0].kind == "provider" and m.kernels[0].ref == "prewarm_kernels.kda.serving"


def test_kimi_linear_h200_spec():
    raw = load(REPO / "manifests/kimi-linear-h200.toml").spec()
    assert set(raw) == {"backend", "arch", "device", "model", "parallel", "dtypes", "serving"}  # [spec] as written
    spec = read_kda(raw)
    assert (spec["backend"], spec["arch"], spec["heads"], spec["gate_lower_bound"]) == ("cuda", "sm_90", 32, None)
    assert set(spec) == {"backend", "arch", "device", "heads", "attention_tp", "head_k_dim", "head_v_dim", "dtype",
                         "dtypes", "gate_lower_bound", "prefill", "decode_batch_buckets", "draft_widths", "fused_gate",
                         "qk_l2norm", "layers", "max_prefill_tokens", "max_running_requests", "calls", "scale",
                         "allow_neg_eigval"}
    assert spec["dtype"] == "bfloat16"
    assert spec["dtypes"] == {"activation": ["bfloat16"], "gate": ["bfloat16", "float32"],
                              "beta": ["bfloat16", "float32"], "gate_params": ["bfloat16", "float32"],
                              "state": ["float32"], "index": ["int32", "int64"]}  # fla's roles: their defaults
    assert spec["fused_gate"] is True and spec["qk_l2norm"] is True


def test_attention_tp_divides_heads(tmp_path):
    spec = read_kda(load(write(tmp_path, GOOD)).spec())
    assert spec["attention_tp"] == 4 and spec["heads"] == 8 and spec["dtype"] == "bfloat16"


def test_dtypes_default_and_lists(tmp_path):
    """No [spec.dtypes]: bf16 for both roles; gate defaults to the activation dtype(s); a string or a list."""
    def dtypes(text: str) -> dict:
        read = read_kda(load(write(tmp_path, text)).spec())["dtypes"]
        return {role: read[role] for role in ("activation", "gate")}

    assert dtypes(GOOD) == {"activation": ["bfloat16"], "gate": ["bfloat16"]}
    text = GOOD + '[spec.dtypes]\nactivation = ["bfloat16", "float16"]\n'
    assert dtypes(text) == {"activation": ["bfloat16", "float16"], "gate": ["bfloat16", "float16"]}
    assert read_kda(load(write(tmp_path, text)).spec())["dtype"] == "bfloat16"  # the first activation dtype
    assert dtypes(GOOD + '[spec.dtypes]\nactivation = "float16"\ngate = "float32"\n') == {
        "activation": ["float16"], "gate": ["float32"]}


@pytest.mark.parametrize(
    "table, key, expected",
    [
        ('activation = "bf16"', "spec.dtypes.activation = 'bf16'", "one of bfloat16, float16, float32"),
        ("activation = []", "spec.dtypes.activation = []", "a non-empty list of distinct ones"),
        ('gate = ["float32", "float32"]', "spec.dtypes.gate = ['float32', 'float32']", "distinct"),
        ("gate = 32", "spec.dtypes.gate = 32", "one of bfloat16, float16, float32"),
        ('betas = "bfloat16"', "spec.dtypes.betas = 'bfloat16'",
         "no such key here (known: activation, beta, gate, gate_params, index, state)"),
        ('index = ["int16"]', "spec.dtypes.index = ['int16']", "one of int32, int64, or a non-empty list"),
    ],
)
def test_bad_dtypes_name_file_key_value_and_expectation(tmp_path, table, key, expected):
    path = write(tmp_path, GOOD + f"[spec.dtypes]\n{table}\n")
    msg = spec_error(path)
    assert str(path) in msg and key in msg and expected in msg


def test_serving_switches(tmp_path):
    text = GOOD.replace("[spec.serving]", "[spec.serving]\nfused_gate = false\nqk_l2norm = false")
    spec = read_kda(load(write(tmp_path, text)).spec())
    assert (spec["fused_gate"], spec["qk_l2norm"]) == (False, False)
    bound = GOOD.replace("head_v_dim = 128", "head_v_dim = 128\ngate_lower_bound = -5.0")
    msg = spec_error(write(tmp_path, bound.replace("[spec.serving]", "[spec.serving]\nfused_gate = false")))
    assert "spec.serving.fused_gate = False: expected true when spec.model.gate_lower_bound is set" in msg
    msg = spec_error(write(tmp_path, GOOD.replace("[spec.serving]", '[spec.serving]\nqk_l2norm = "yes"')))
    assert "spec.serving.qk_l2norm = 'yes': expected true or false" in msg


def test_heads_that_do_not_divide_name_file_heads_and_tp(tmp_path):
    path = write(tmp_path, GOOD.replace("kda_heads = 32", "kda_heads = 30"))
    msg = spec_error(path)
    assert str(path) in msg and "spec.model.kda_heads = 30" in msg and "attention-TP 4" in msg
    assert "a multiple of attention-TP 4" in msg and "kernels[0].provider = 'prewarm_kernels.kda.serving'" in msg


@pytest.mark.parametrize(
    "old, new, key, expected",
    [
        ('backend = "cuda"', 'backend = "rocm"', "target.backend = 'rocm'", "one of cuda, npu"),
        ('arch = "sm_90"', 'arch = "hopper"', "target.arch = 'hopper'", "'sm_90'"),
        ('provider = "prewarm_kernels.kda.serving"', 'provider = "some provider"',
         "kernels[0].provider = 'some provider'", "importable module"),
        ("[spec.model]", '[spec]\ndevice = "H200"\n[spec.model]', "spec.device = 'H200'", "in [target]"),
    ],
)
def test_bad_core_values_name_file_key_value_and_expectation_at_load(tmp_path, old, new, key, expected):
    path = write(tmp_path, GOOD.replace(old, new))
    with pytest.raises(ManifestError) as e:
        load(path)
    msg = str(e.value)
    assert str(path) in msg and key in msg and expected in msg


@pytest.mark.parametrize(
    "old, new, key, expected",
    [
        ("kda_heads = 32", "kda_heads = 0", "spec.model.kda_heads = 0", "a positive integer"),
        ("kda_heads = 32", 'kda_heads = "32"', "spec.model.kda_heads = '32'", "a positive integer"),
        ("[1, 2, 4]", "[1, 2, 2]", "spec.serving.decode_batch_buckets = [1, 2, 2]", "distinct positive integers"),
        ("[1, 2, 4]", "[1, 0]", "spec.serving.decode_batch_buckets = [1, 0]", "distinct positive integers"),
        ("attention_dp = 2", "attention_dp = 3", "spec.parallel.attention_dp = 3", "a divisor of"),
        ("head_v_dim = 128", "head_v_dim = 128\nhead_dim = 64", "spec.model.head_dim = 64", "no such key"),
        ("head_k_dim = 128", "head_k_dim = 512", "spec.model.head_k_dim = 512", "at most 256"),
        ("[spec.serving]", "[spec.srving]", "spec.srving = ", "no such key here (known: arch, backend, device, "
         "dtypes, model, parallel, serving)"),
    ],
)
def test_bad_spec_values_name_file_key_value_and_expectation_at_plan(tmp_path, old, new, key, expected):
    path = write(tmp_path, GOOD.replace(old, new))
    msg = spec_error(path)
    assert str(path) in msg and key in msg and expected in msg


def test_the_old_form_is_refused_with_the_move(tmp_path):
    old = GOOD.replace("[spec.model]", "[model]").replace("[spec.serving]", "[serving]")
    path = write(tmp_path, old)
    with pytest.raises(ManifestError) as e:
        load(path)
    assert str(e.value) == (f"{path}: [model] is the old form: expected it under [spec] (rename [model], [serving] "
                            f"to [spec.model], [spec.serving])")
    path = write(tmp_path, 'spec = 3\n[target]\nbackend = "cuda"\narch = "sm_90"\n[[kernels]]\nfunction = "a:b"\n')
    with pytest.raises(ManifestError, match=r"m\.toml: spec = 3: expected a table of the providers' settings"):
        load(path)


def test_kernel_entry_needs_exactly_one_source(tmp_path):
    path = write(tmp_path, GOOD.replace('provider = "prewarm_kernels.kda.serving"', 'provider = "a.b"\nfunction = "a:b"'))
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
    err = capsys.readouterr().err.replace("\n", "")
    assert "spec.model.kda_heads = 31" in err and "Traceback" not in err


def test_a_record_only_manifest_needs_no_spec_and_a_provider_says_what_it_lacks(tmp_path):
    """The core reads [target] and [[kernels]]; [spec] is the provider's business."""
    (tmp_path / "calls.jsonl").write_text("")
    path = tmp_path / "rec.toml"
    path.write_text('[target]\nbackend = "cuda"\narch = "sm_90"\ndevice = "H200"\n[[kernels]]\nrecord = "calls.jsonl"\n')
    m = load(path)
    assert m.spec() == {"backend": "cuda", "arch": "sm_90", "device": "H200"}
    path.write_text('[target]\nbackend = "cuda"\narch = "sm_90"\n[[kernels]]\nprovider = "prewarm_kernels.kda.serving"\n')
    assert spec_error(path) == (f"{path}: spec.model.kda_heads is missing: expected a positive integer (checked by "
                                f"kernels[0].provider = 'prewarm_kernels.kda.serving')")
    path.write_text('[target]\nbackend = "cuda"\narch = "sm_90"\n[[kernels]]\nprovider = "prewarm.providers.fla.kda"\n'
                    '[spec.model]\nkda_heads = 4\nhead_k_dim = 64\nhead_v_dim = 64\n[spec.serving]\ndraft_width = [2]\n')
    assert spec_error(path).startswith(f"{path}: spec.serving.draft_width = [2]: expected no such key here")
