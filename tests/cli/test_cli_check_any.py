"""`peat check KERNEL --reference REF`: any kernel against any function (a jax, flax or optax one
by its dotted name), driven in-process through `cli.main` as a user's shell would."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from peat_jax._src import cli, kernel_spec
from peat_jax._src.errors import PeatError

TESTS = pathlib.Path(__file__).resolve().parents[1]
QKV = "1x4x1x4,1x4x1x4,1x4x1x4"   # [batch, length, heads, head_dim], three times
CAUSAL = '{"is_causal": true}'


def check(capsys, *argv: str):
    """(exit status, stdout, stderr) of `peat check ARGV...`."""
    rc = cli.main(["check", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def check_json(capsys, *argv: str):
    rc, out, err = check(capsys, *argv, "--json")
    assert out.count("\n") == 1, (out, err[-2000:])
    return rc, json.loads(out)


@pytest.mark.slow
def test_a_softmax_port_passes_against_jax_nn_softmax(capsys):
    rc, d = check_json(capsys, "cli_kernels:softmax", "--reference", "jax.nn.softmax",
                       "--shapes", "4x8", "--variants", "example,large,odd_shape")
    assert rc == 0 and d["passed"] and d["model"] in ("exact", "numerical_noise"), d["summary"]
    assert d["candidate"] == "cli_kernels:softmax" and d["reference"] == "jax.nn.softmax"
    assert d["operands"] == [{"shape": [4, 8], "dtype": "float32"}] and "seeds" not in d
    assert {v for v, _, _ in d["evidence"]["checks"]} == {"example", "large", "odd_shape"}


def test_a_buggy_port_fails_on_every_seed_with_its_model_named(capsys):
    """Named by file path; --seeds 2 runs the check at seeds 0 and 1 and reports each."""
    rc, d = check_json(capsys, f"{TESTS / 'cli_kernels.py'}:softmax_scaled", "--reference",
                       "jax.nn.softmax", "--shapes", "4x8", "--variants", "example",
                       "--seeds", "2")
    assert rc == 1 and not d["passed"] and d["model"] == "wrong_scale", d["summary"]
    assert [(s["seed"], s["model"], s["passed"]) for s in d["seeds"]] == [
        (0, "wrong_scale", False), (1, "wrong_scale", False)]
    assert d["seed"] == 0 and "1.01x" in d["summary"]


@pytest.mark.slow
def test_attention_against_dot_product_attention_with_kwargs_from_config(capsys):
    """`--reference jax.nn.dot_product_attention` is the reference (not a prefix of
    --reference-precision); --config's is_causal reaches both: the port with the mask passes,
    the one ignoring it fails."""
    rc, out, err = check(capsys, "cli_kernels:attention", "--reference",
                         "jax.nn.dot_product_attention", "--shapes", QKV, "--config", CAUSAL,
                         "--variants", "example")
    assert rc == 0, err[-2000:]
    assert out.startswith("passes:") and "reference_precision: highest" in out
    rc, d = check_json(capsys, "cli_kernels:attention_without_mask", "--reference",
                       "jax.nn.dot_product_attention", "--shapes", QKV, "--config", CAUSAL,
                       "--variants", "example")
    assert rc == 1 and not d["passed"] and d["kwargs"] == {"is_causal": True}, d["summary"]


def test_integer_labels_are_drawn_in_range_for_an_optax_loss(capsys):
    rc, d = check_json(capsys, "cli_kernels:cross_entropy_integer_labels", "--reference",
                       "optax.softmax_cross_entropy_with_integer_labels", "--shapes", "6x5,6",
                       "--dtypes", "float32,int32", "--variants", "example,large")
    assert rc == 0 and d["passed"], d["summary"]
    assert d["operands"][1] == {"shape": [6], "dtype": "int32"}
    # only the logits are differentiated
    assert {out for _, out, _ in d["evidence"]["checks"]} >= {"forward", "grad[0]"}
    assert not any("grad[1]" in out for _, out, _ in d["evidence"]["checks"])


def test_config_from_a_json_file_and_from_a_python_spec(capsys, tmp_path):
    cfg = tmp_path / "softmax.json"
    cfg.write_text('{"axis": [0]}')
    rc, d = check_json(capsys, "cli_kernels:softmax", "--reference", "jax.nn.softmax",
                       "--shapes", "5x6", "--config", str(cfg), "--variants", "example")
    assert rc == 0 and d["kwargs"] == {"axis": [0]}, d["summary"]   # a tuple, as JSON
    rc, d = check_json(capsys, "cli_kernels:softmax", "--reference", "jax.nn.softmax",
                       "--config", "cli_kernels:softmax_spec", "--variants", "example",
                       "--seeds", "2")
    assert rc == 0 and [s["passed"] for s in d["seeds"]] == [True, True], d["summary"]
    assert d["operands"] == [{"shape": [5, 6], "dtype": "float32"}] and d["kwargs"] == {"axis": 0}


@pytest.mark.slow
def test_kwargs_for_one_side_only_where_a_port_names_them_otherwise(capsys, tmp_path):
    """--kernel-kwargs and --reference-kwargs reach one side each (over --config's): a port's
    eps against jax.nn.standardize's epsilon. The same eps passes; a reference at another eps
    fails, and the JSON says which kwargs each side had."""
    port = ("cli_kernels:layer_norm", "--reference", "jax.nn.standardize", "--shapes", "6x20",
            "--variants", "example", "--kernel-kwargs", '{"eps": 1e-5}')
    rc, d = check_json(capsys, *port, "--reference-kwargs", '{"epsilon": 1e-5}')
    assert rc == 0 and d["kwargs"] == {"eps": 1e-5}, d["summary"]
    assert d["reference_kwargs"] == {"epsilon": 1e-5}
    ref = tmp_path / "ref.json"
    ref.write_text('{"epsilon": 1e-3}')
    rc, d = check_json(capsys, *port, "--reference-kwargs", str(ref))
    assert rc == 1 and d["reference_kwargs"] == {"epsilon": 1e-3}, d["summary"]


def test_reference_is_never_a_prefix_of_another_option():
    parser = cli.build_parser()
    args = parser.parse_args(["check", "m:f", "--reference", "jax.nn.dot_product_attention"])
    assert args.reference == "jax.nn.dot_product_attention"
    assert args.reference_precision == "highest"
    for abbreviated in (["--reference-p", "default"], ["--refer", "jax.nn.softmax"],
                        ["--conf", "{}"]):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(["check", "m:f", *abbreviated])
        assert e.value.code == 2


@pytest.mark.parametrize("argv,needle", [
    (["nosuchmod:f", "--reference", "jax.nn.softmax", "--shapes", "4x8"],
     "cannot import module 'nosuchmod'"),
    (["cli_kernels:softmax", "--reference", "jax.nn.softmaxx", "--shapes", "4x8"],
     "no attribute 'softmaxx'"),
    (["cli_kernels:softmax", "--reference", "nosuchpkg.softmax", "--shapes", "4x8"],
     "cannot import module 'nosuchpkg'"),
    (["nofile.py:f", "--reference", "jax.nn.softmax", "--shapes", "4x8"], "no such file"),
    (["cli_kernels:softmax", "--reference", "jax.nn", "--shapes", "4x8"], "is a module"),
    (["cli_kernels:softmax", "--reference", "jax.nn.softmax", "--shapes", "4by8"],
     "--shapes must look like 64x32,32x16"),
    (["cli_kernels:softmax", "--reference", "jax.nn.softmax"], "give --shapes"),
    (["cli_kernels:attention", "--reference", "jax.nn.dot_product_attention", "--shapes", QKV,
      "--dtypes", "float32,float32"], "--dtypes gave 2 dtypes for 3 operand(s)"),
    (["cli_kernels:softmax", "--reference", "jax.nn.softmax", "--shapes", "4x8", "--dtypes",
      "float64"], "unknown dtype 'float64'"),
    (["cli_kernels:softmax", "--reference", "jax.nn.softmax", "--shapes", "4x8", "--config",
      '{"axis": -1,}'], "is not valid JSON"),
    (["cli_kernels:softmax", "--reference", "jax.nn.softmax", "--shapes", "4x8", "--config",
      "[1, 2]"], "neither JSON"),
    (["cli_kernels:softmax", "--reference", "jax.nn.softmax", "--shapes", "4x8", "--config",
      "missing.json"], "no such --config file"),
    (["cli_kernels:softmax", "--reference", "jax.nn.softmax", "--shapes", "4x8", "--config",
      "cli_kernels:softmax_spec"], "returned the example args"),
    (["cli_kernels:softmax", "--reference", "jax.nn.softmax", "--shapes", "4x8", "--variants",
      "exampel"], "unknown variants"),
    (["cli_kernels:softmax", "--shapes", "4x8"], "give --reference"),
    (["cli_kernels:softmax", "--reference", "jax.nn.softmax", "--shapes", "4x8",
      "--kernel-kwargs", "axis=0"], "--kernel-kwargs 'axis=0' is neither inline JSON nor"),
    (["cli_kernels:softmax", "--reference", "jax.nn.softmax", "--shapes", "4x8",
      "--reference-kwargs", "[0]"], "--reference-kwargs (inline) must be a JSON object"),
    (["pallas_matmul", "--kernel-kwargs", "{}"], "--kernel-kwargs needs --reference"),
    (["pallas_matmull", "--reference", "jax.nn.softmax", "--shapes", "4x8"],
     "unknown kernel 'pallas_matmull'"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, needle):
    rc, out, err = check(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.startswith("peat: error: ") and err.count("\n") == 1, err
    assert needle in err and "Traceback" not in err


def test_a_file_that_fails_to_load_is_one_line(capsys, tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("def f(x):\n    return x +\n")
    rc, _, err = check(capsys, f"{bad}:f", "--reference", "jax.nn.softmax", "--shapes", "4")
    assert rc == 2 and err.count("\n") == 1 and "SyntaxError" in err, err


def test_names_load_in_every_form(tmp_path):
    import flax.linen
    import jax

    assert kernel_spec.load("jax.nn.dot_product_attention") is jax.nn.dot_product_attention
    assert kernel_spec.load("flax.linen.dot_product_attention") is \
        flax.linen.dot_product_attention
    assert kernel_spec.load("jax.nn:softmax") is jax.nn.softmax
    mod = tmp_path / "mine.py"
    mod.write_text("class K:\n    @staticmethod\n    def f(x):\n        return x\n")
    f = kernel_spec.load(f"{mod}:K.f")
    assert f(3) == 3 and kernel_spec.load(f"{mod}:K.f") is f   # the file is loaded once
    # a factory taking no arguments is called; a function taking operands is kept
    import cli_kernels
    assert kernel_spec.as_function(cli_kernels.correct_matmul, "m:f").name == "correct_matmul"
    assert kernel_spec.as_function(cli_kernels.softmax, "m:f") is cli_kernels.softmax
    with pytest.raises(PeatError, match="not a function"):
        kernel_spec.as_function(3, "m:x")


def test_shapes_dtypes_and_drawn_args():
    assert kernel_spec.parse_shapes("2x3, (),scalar,7") == [(2, 3), (), (), (7,)]
    assert [d.name for d in kernel_spec.parse_dtypes("bf16", 2)] == ["bfloat16"] * 2
    shapes, dtypes = [(6, 5), (6,), (), (3, 4)], kernel_spec.parse_dtypes(
        "float32,int32,float16,bool", 4)
    a = kernel_spec.draw_args(shapes, dtypes, seed=0)
    assert [x.shape for x in a] == shapes and [x.dtype.name for x in a] == [
        "float32", "int32", "float16", "bool"]
    assert a[1].min() >= 0 and a[1].max() < 5   # labels index the logits' last axis
    again, other = kernel_spec.draw_args(shapes, dtypes, 0), kernel_spec.draw_args(shapes,
                                                                                  dtypes, 1)
    assert all(np.array_equal(x, y) for x, y in zip(a, again))
    assert not np.array_equal(a[0], other[0])
    wide = kernel_spec.draw_args([(200,)], kernel_spec.parse_dtypes("int32", 1), 0, int_high=3)
    assert set(np.unique(wide[0])) == {0, 1, 2}
    with pytest.raises(PeatError, match="does not fit uint8"):
        kernel_spec.draw_args([(2,)], kernel_spec.parse_dtypes("uint8", 1), 0, int_high=1000)
    cfg = kernel_spec.parse_config('{"axis": [0, 1], "eps": 1e-5}')
    assert cfg.kwargs == {"axis": (0, 1), "eps": 1e-5} and cfg.args is None
