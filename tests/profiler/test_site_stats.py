"""Site statistics in the golden run, training with a candidate in place, and `peat.compare`:
where two runs part ways. Real differences only: a fault or a kernel substituted for the run."""
from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest

import peat_jax as peat
import peat_jax._src.profiler.site_stats as site_stats_module
from peat_jax import models
from peat_jax._src import cli
from peat_jax._src.profiler.golden import profile, restore
from peat_jax._src.profiler.rundir import RunDir
from peat_jax._src.profiler.site_stats import (SAMPLE_DENSITY, SAMPLE_SIZE, ChunkWriter, Sampling,
                                               StatsStep, batch_stats, drop_steps, read_sampling,
                                               read_sites, read_step, recorded_steps,
                                               sample_indices, site_stats, unpack, write_chunk,
                                               write_sites)

from conftest import bitwise_equal

STEPS = 3


def _wl():
    return models.get("vision", batch_size=16, width=8, hidden=32)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: run dir}: plain (no stats), ref and again (stats every step), scaled (a fault at
    one backward dot_general), pallas (the Pallas matmul at every dot_general)."""
    root = tmp_path_factory.mktemp("stats")
    wl = _wl()
    out = {name: root / name for name in ("plain", "ref", "again", "scaled", "pallas")}
    profile(wl, out["plain"], steps=STEPS, checkpoint_every=STEPS)
    profile(wl, out["ref"], steps=STEPS, checkpoint_every=STEPS, stats_every=1)
    profile(wl, out["again"], steps=STEPS, checkpoint_every=STEPS, stats_every=1)
    profile(wl, out["scaled"], steps=STEPS, checkpoint_every=STEPS, stats_every=1,
            substitution={_bwd_gemm(wl).index: peat.faults.wrong_scale(1.5)})
    profile(wl, out["pallas"], steps=STEPS, checkpoint_every=STEPS, stats_every=1,
            substitution={"dot_general": peat.kernels.pallas_matmul()})
    return out


def _bwd_gemm(wl) -> peat.Site:
    """The second backward dot_general of the train step."""
    state = wl.init(jax.random.key(0))
    batch = jax.tree.map(jax.numpy.asarray, wl.batch(0))
    sites = peat.list_sites(wl.train_step, state, batch)
    return [s for s in sites if s.primitive == "dot_general" and s.phase == "bwd"][1]


# jax 0.12.1's XLA:CPU computes a GEMM whose transpose it folds into it (XNNPACK, operands
# swapped) in another order than the unfolded GEMM: the plain step folds the hidden layer's weight
# gradient, the statistics step reads it unfolded (docs/compare.md)
_FOLDS_READ_GEMMS = tuple(int(v) for v in jax.__version__.split(".")[:3]) >= (0, 12, 1)


@pytest.mark.slow
def test_stats_leave_the_trajectory_unchanged(runs):
    """Bitwise where XLA compiles the step's GEMMs alike with and without statistics; on jax
    0.12.1 within a few ULPs of each leaf's scale. Two runs with statistics are bitwise equal
    either way (stats_every=K is reproducible)."""
    plain, ref = RunDir(runs["plain"]), RunDir(runs["ref"])
    assert plain.golden_losses() == ref.golden_losses()
    with_stats = restore(runs["ref"], STEPS)
    assert bitwise_equal(with_stats, restore(runs["again"], STEPS))
    if not _FOLDS_READ_GEMMS:
        assert bitwise_equal(restore(runs["plain"], STEPS), with_stats)
        return
    for a, b in zip(jax.tree.leaves(restore(runs["plain"], STEPS)), jax.tree.leaves(with_stats)):
        if jax.dtypes.issubdtype(a.dtype, jax.numpy.floating):
            a, b = np.asarray(a), np.asarray(b)
            assert np.abs(a - b).max() <= 1e-6 * np.abs(a).max(), (a, b)


def test_stats_files_are_pickle_free_and_complete(runs):
    rd = RunDir(runs["ref"])
    assert recorded_steps(rd.site_stats) == list(range(STEPS))
    sites = read_sites(rd.site_stats)
    recorded = [s for s in sites if s.recorded]
    assert len(recorded) == len(sites) > 30
    # one file for the steps of the checkpoint interval, and the compact sites.json
    assert sorted(p.name for p in rd.site_stats.iterdir()) == [f"0-{STEPS - 1}.npz", "sites.json"]
    assert b"\n" not in (rd.site_stats / "sites.json").read_bytes().rstrip()
    with np.load(rd.site_stats / f"0-{STEPS - 1}.npz", allow_pickle=False) as z:
        assert z["steps"].tolist() == list(range(STEPS))
        assert z["floats"].shape == (STEPS, len(recorded), 4)
        assert z["words"].shape == (STEPS, len(recorded), 2) and z["words"].dtype == np.uint32
        assert z["sample"].shape == (STEPS, sum(s.sample_size for s in recorded))
    assert {s.phase for s in sites} == {"fwd", "bwd"}
    assert not RunDir(runs["plain"]).site_stats.exists()


def test_identical_runs_do_not_differ(runs):
    c = peat.compare(runs["ref"], runs["again"])
    assert c.first_step is None and c.first_site is None and c.first_difference is None
    assert c.diagnosis is None
    assert np.all(np.asarray(c.grid) == 0)
    assert "no difference" in c.summary()


def test_a_fault_at_one_backward_gemm_is_localised(runs):
    site = _bwd_gemm(_wl())
    c = peat.compare(runs["ref"], runs["scaled"])
    assert c.first_step == 0
    assert (c.first_site.index, c.first_site.phase, c.first_site.primitive) == \
        (site.index, "bwd", "dot_general")
    assert c.diagnosis.model == "wrong_scale" and not c.diagnosis.passed
    assert c.first_difference is c.divergence
    sub = RunDir(runs["scaled"]).manifest()["substitution"]
    assert sub == [{"selector": repr(site.index), "candidate": peat.faults.wrong_scale(1.5).name,
                   "sites": [site.index]}]
    differs = {r.key for r in c.environments if r.differs}
    assert differs == {"substitution"}


def test_the_pallas_matmul_everywhere_is_noise(runs):
    c = peat.compare(runs["ref"], runs["pallas"])
    assert c.first_step is None and c.divergence is None
    first = c.first_difference
    assert first is not None and first.step == 0
    assert first.site.primitive == "dot_general" and first.site.phase == "fwd"
    assert first.diagnosis.model in ("numerical_noise",) and c.diagnosis is first.diagnosis
    assert "no divergence beyond noise" in c.summary()


def test_compare_cli_json_and_report(runs, capsys):
    rc = cli.main(["compare", str(runs["ref"]), str(runs["scaled"]), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1
    assert out["first_step"] == 0
    assert set(out["first_site"]) == {"index", "primitive", "phase", "path"}
    assert out["first_site"]["phase"] == "bwd" and out["diagnosis"]["model"] == "wrong_scale"
    assert {"environments", "first_difference", "grid", "steps", "sites"} <= set(out)
    html = (runs["ref"] / "report.html").read_text()
    assert "Comparison with" in html and 'class="grid heat"' in html
    assert cli.main(["compare", str(runs["ref"]), str(runs["again"]), "--json"]) == 0
    capsys.readouterr()
    assert cli.main(["compare", str(runs["ref"]), str(runs["scaled"]), "--replay", "--json"]) == 1
    replay = json.loads(capsys.readouterr().out)["replay"]
    assert replay["site"] == out["first_site"] and replay["checkpoint"] == 0
    assert replay["diagnosis"]["model"] == "wrong_scale" and replay["matches_a"]


def test_replay_diagnoses_the_diverging_site_on_this_backend(runs):
    site = _bwd_gemm(_wl())
    c = peat.compare(runs["ref"], runs["scaled"], replay=True)
    r = c.replay
    assert (r.step, r.checkpoint, r.site) == (0, 0, c.first_site)
    assert (r.site.index, r.site.phase) == (site.index, "bwd")
    assert r.diagnosis.model == "wrong_scale" and not r.diagnosis.passed
    assert r.matches_a and r.relative_difference_a == 0.0  # XLA:CPU reproduces run a bitwise
    assert r.relative_difference == pytest.approx(0.5, rel=1e-3)
    assert "replayed on cpu" in c.summary()
    assert peat.compare(runs["ref"], runs["again"], replay=True).replay is None


def test_replay_needs_a_checkpoint_before_the_step(runs, tmp_path):
    ref, scaled = tmp_path / "ref", tmp_path / "scaled"
    shutil.copytree(runs["ref"], ref)
    shutil.copytree(runs["scaled"], scaled)
    shutil.rmtree(RunDir(ref).checkpoints / "0")
    with pytest.raises(peat.PeatError, match=r"no checkpoint at or before step 0.*\[3\]"):
        peat.compare(ref, scaled, replay=True)
    with pytest.raises(peat.PeatError, match="substitution"):
        peat.compare(runs["scaled"], runs["ref"], replay=True)


def test_replay_takes_the_workload_object(runs):
    with pytest.raises(peat.PeatError, match=r"workload='other'"):
        peat.compare(runs["ref"], runs["scaled"], replay=True,
                     workload=_wl()._replace(name="other"))
    r = peat.compare(runs["ref"], runs["scaled"], replay=True, workload=_wl()).replay
    assert r.diagnosis.model == "wrong_scale" and r.matches_a


def test_profile_rejects_a_bad_stats_interval(tmp_path):
    with pytest.raises(peat.PeatError, match="stats_every"):
        profile(_wl(), tmp_path / "r", steps=2, checkpoint_every=1, stats_every=0)


def test_compare_needs_statistics(runs):
    with pytest.raises(peat.PeatError, match="stats_every"):
        peat.compare(runs["plain"], runs["ref"])


@pytest.mark.slow
def test_profile_cli_trains_with_a_fault_in_place(tmp_path, capsys):
    run = tmp_path / "run"
    rc = cli.main(["profile", "vision", "--out", str(run), "--steps", "2", "--checkpoint-every",
                   "2", "--stats-every", "2", "--fault", "wrong_scale(1.5)", "--sites",
                   "bwd:dot_general", "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["steps"] == 2
    m = RunDir(run).manifest()
    assert m["stats_every"] == 2 and m["substitution"][0]["selector"] == "'bwd:dot_general'"
    assert recorded_steps(RunDir(run).site_stats) == [0]


def _outputs():
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(s).astype(np.float32) for s in [(3,), (700,), (512,), (33, 65)]]
    xs[1][5], xs[1][7], xs[1][9] = 0.0, np.nan, -np.inf
    xs.append(np.zeros((40,), np.float32))
    xs.append(rng.standard_normal(1000).astype(jax.numpy.bfloat16))
    xs.append(rng.integers(-5, 5, (300,)).astype(np.int32))
    xs.append(rng.standard_normal((1 << 16) + 3).astype(np.float32))  # reduced where it is
    return [jax.numpy.asarray(x) for x in xs]


@pytest.mark.slow
def test_batched_statistics_are_each_outputs_own():
    """`batch_stats` (one shared buffer for the small outputs) records what `site_stats` records
    for each output alone: the same checksum, sample and counts, sums up to rounding."""
    xs = _outputs()
    batched, each = jax.device_get(jax.jit(lambda xs: (batch_stats(xs),
                                                       [site_stats(x) for x in xs]))(xs))
    offset = 0
    for i, alone in enumerate(each):
        m = len(alone.sample)
        assert batched.checksum[i] == alone.checksum and batched.nonfinite[i] == alone.nonfinite
        assert batched.zeros[i] == alone.zeros
        np.testing.assert_array_equal(batched.sample[offset:offset + m], alone.sample)
        for k in ("absmax", "mean", "rms"):  # NaN or inf alike where the output has either
            b, a = getattr(batched, k)[i], getattr(alone, k)
            if alone.nonfinite:
                assert not np.isfinite(b) and not np.isfinite(a)
            else:
                np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
        offset += m
    assert batched.nonfinite[1] == 2 and batched.zeros[4] == 1.0
    flipped = xs[2].at[100].set(-xs[2][100])
    moved = xs[2].at[jax.numpy.array([3, 4])].set(xs[2][jax.numpy.array([4, 3])])
    sums = [int(jax.jit(batch_stats)([x]).checksum[0]) for x in (xs[2], flipped, moved)]
    assert len(set(sums)) == 3  # a flipped sign bit and two swapped elements both change it


@pytest.mark.parametrize("fold_max", [site_stats_module.FOLD_MAX, 0], ids=["product", "gathered"])
@pytest.mark.parametrize("dtype", [np.float32, jax.numpy.bfloat16])
def test_batched_sums_keep_each_outputs_non_finite_values_to_itself(dtype, fold_max, monkeypatch):
    """Small outputs share one buffer and one reduction (a matrix product, or gathers where
    there are many): an output's NaN or infinity gives its own mean and rms the value IEEE sums
    give (NaN with a NaN or both infinities, else the infinity; inf where the squares overflow)
    and leaves every other output's finite; the counts and checksum are exact either way."""
    monkeypatch.setattr(site_stats_module, "FOLD_MAX", fold_max)
    rng = np.random.default_rng(1)
    cases = {"nan": [np.nan], "+inf": [np.inf], "-inf": [-np.inf], "both": [np.inf, -np.inf],
             "overflow": [3e38]}
    xs = []
    for i, (name, specials) in enumerate(cases.items()):
        x = rng.standard_normal(700 + 100 * i).astype(np.float32)
        x[[5 + 7 * j for j in range(len(specials))]] = specials
        xs += [x, rng.standard_normal(300).astype(np.float32)]    # a finite neighbour each
    xs = [jax.numpy.asarray(x.astype(dtype)) for x in xs]
    got = jax.device_get(jax.jit(batch_stats)(xs))
    for i, x in enumerate(xs):
        checksum, zeros, nonfinite, _ = _defined(np.asarray(x))
        assert (got.checksum[i], got.nonfinite[i]) == (checksum, nonfinite)
        assert got.zeros[i] == np.float32(zeros) / np.float32(x.size)
        v = np.asarray(x, np.float32).astype(np.float64)
        with np.errstate(all="ignore"):
            mean = np.float32(np.sum(v) / v.size)
            rms = np.float32(np.sqrt(np.sum(np.float32(v) ** 2, dtype=np.float64) / v.size))
        for k, want in (("mean", mean), ("rms", rms)):
            have = getattr(got, k)[i]
            if np.isfinite(want):
                np.testing.assert_allclose(have, want, rtol=1e-5, err_msg=f"{k} of output {i}")
            else:
                assert str(have) == str(want), (k, i, have, want)


def _defined(x: np.ndarray) -> tuple[int, int, int, float]:
    """(checksum, zero count, non-finite count, abs-max or None where the output holds a
    non-finite value) of an output as the module docstring defines them, in NumPy."""
    flat = x.reshape(-1)
    if flat.dtype == np.bool_:
        bits = flat.astype(np.uint64)
    else:
        bits = flat.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[flat.dtype.itemsize])
        bits = bits.astype(np.uint64)
        bits = (bits ^ (bits >> np.uint64(32))) & np.uint64(0xFFFFFFFF)
    index = np.arange(flat.size, dtype=np.uint64)
    checksum = int(np.sum(bits * (np.uint64(2) * index + np.uint64(1))) % (1 << 32))
    v = flat.astype(np.float32)
    return (checksum, int(np.sum(v == 0)), int(np.sum(~np.isfinite(v))),
            float(np.max(np.abs(v))) if np.all(np.isfinite(v)) else None)


@pytest.mark.parametrize("dtype", [np.float32, jax.numpy.bfloat16, np.float16, np.int32, np.bool_])
@pytest.mark.parametrize("shape", [(1,), (3, 5, 7), (64, 24), (1 << 16) + 3, (3, 512, 256)])
def test_statistics_are_exactly_as_defined(dtype, shape):
    """Every output size (powers of two, odd sizes, a multiple of three) and dtype: the checksum,
    zero and non-finite counts and abs-max exactly as defined, alone and batched; the zero share,
    mean and rms up to float32 rounding (abs-max, mean and rms not finite where the output holds
    a non-finite value)."""
    rng = np.random.default_rng(sum(np.atleast_1d(shape)))
    x = np.asarray(rng.standard_normal(shape) * 3).astype(dtype)
    if dtype != np.bool_:
        x.reshape(-1)[::5] = 0
    if np.issubdtype(x.dtype, np.floating) or dtype == jax.numpy.bfloat16:
        x.reshape(-1)[1:x.size:97] = np.inf
        x.reshape(-1)[2:x.size:89] = np.nan
    alone = jax.device_get(jax.jit(site_stats)(jax.numpy.asarray(x)))
    batched = jax.device_get(jax.jit(batch_stats)([jax.numpy.asarray(x)]))
    checksum, zeros, nonfinite, absmax = _defined(x)
    v = x.reshape(-1).astype(np.float64)
    for got, i in ((alone, ()), (batched, 0)):
        assert int(got.checksum[i]) == checksum
        assert int(got.nonfinite[i]) == nonfinite
        assert round(float(got.zeros[i]) * x.size) == zeros
        if nonfinite:
            assert not np.isfinite([got.absmax[i], got.mean[i], got.rms[i]]).any()
        else:
            assert float(got.absmax[i]) == absmax
            np.testing.assert_allclose(got.mean[i], v.mean(), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(got.rms[i], np.sqrt(np.mean(v * v)), rtol=1e-5)


@pytest.mark.parametrize("at", [0, -1])
@pytest.mark.parametrize("n", [100, 4096, 60000, 1 << 16, 1 << 18])
def test_an_output_holding_a_nan_has_a_nan_abs_max(n, at):
    """Alone and batched, whatever its size and where the NaN is: on jax 0.10 and 0.11 XLA:CPU's
    float max skips NaNs from 4096 elements up (1 or -inf here, for ones and a NaN)."""
    x = np.ones(n, np.float32)
    x[at] = np.nan
    alone = jax.jit(site_stats)(jax.numpy.asarray(x))
    batched = jax.jit(batch_stats)([jax.numpy.asarray(x), jax.numpy.ones(10)])
    assert np.isnan(float(alone.absmax)) and np.isnan(float(batched.absmax[0]))
    assert int(alone.nonfinite) == int(batched.nonfinite[0]) == 1
    assert float(batched.absmax[1]) == 1.0


@pytest.mark.parametrize("shape", [(1024, 256), (64, 64, 64)])
def test_the_statistics_of_a_large_output_copy_none_of_it(shape):
    """The statistics of a site output inside a scan (`site_stats`, every iteration) write no
    summand out at full size: their scratch memory, the six statistics' partial sums over groups
    of 8 elements, is under the output's own size, where XLA:CPU would otherwise write the
    weighted bit patterns and the zero mask out in full before reducing them (twice the
    output)."""
    x = jax.numpy.ones(shape, jax.numpy.float32)
    compiled = jax.jit(site_stats).lower(x).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < x.nbytes


@pytest.mark.parametrize("n, kept", [(0, 0), (1, 1), (32, 1), (255, 1), (256, 2), (640, 5),
                                     (8191, 63), (8192, 64), (10 ** 6, 64)])
def test_the_sample_scales_with_the_output_and_stays_under_one_percent(n, kept):
    idx = sample_indices(n)
    assert len(idx) == kept and len(set(idx.tolist())) == kept
    assert kept <= max(1, n // SAMPLE_DENSITY) and (n < SAMPLE_DENSITY or kept / n < 0.01)
    assert np.all(np.diff(idx) > 0) and (n == 0 or idx[-1] < n)
    assert sample_indices(n, Sampling(SAMPLE_SIZE, 1)).size == min(n, SAMPLE_SIZE)  # older runs


def _packed(step: int, sites: int = 3, sample: int = 5) -> dict:
    rng = np.random.default_rng(step)
    return {"floats": rng.standard_normal((sites, 4)).astype(np.float32),
            "words": rng.integers(0, 2 ** 32, (sites, 2), dtype=np.uint32),
            "sample": rng.standard_normal(sample).astype(np.float32)}


_np_load = np.load


def _assert_step(directory, step):
    got, want = read_step(directory, step), unpack(_packed(step))
    assert set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in want)


def test_chunks_and_older_step_files_read_alike_and_a_resume_drops_its_steps(tmp_path, monkeypatch):
    d = tmp_path / "site_stats"
    writer = ChunkWriter(d, chunk_steps=2)  # every 2nd step: steps 0, 2 | 4, 6 | then 8 alone
    for step in (0, 2, 4, 6):
        writer.add(step, _packed(step))
    writer.flush()  # nothing left: no empty file
    np.savez_compressed(d / "8.npz", **_packed(8))  # a step file of a run profiled before chunks
    assert sorted(p.name for p in d.iterdir()) == ["0-2.npz", "4-6.npz", "8.npz"]
    loads = []
    monkeypatch.setattr(np, "load", lambda *a, **k: loads.append(a[0]) or _np_load(*a, **k))
    assert recorded_steps(d) == [0, 2, 4, 6, 8]
    for _ in range(3):  # listing the steps and walking them reads each file once
        for step in (0, 2, 4, 6, 8):
            _assert_step(d, step)
    assert sorted(map(str, loads)) == sorted(str(d / n) for n in ("0-2.npz", "4-6.npz", "8.npz"))
    with pytest.raises(peat.PeatError, match="no statistics of step 3"):
        read_step(d, 3)

    drop_steps(d, 5)  # resuming from checkpoint 5: the chunk 4-6 keeps step 4, 8.npz goes
    assert sorted(p.name for p in d.iterdir()) == ["0-2.npz", "4-4.npz"]
    assert recorded_steps(d) == [0, 2, 4]
    for step in (0, 2, 4):
        _assert_step(d, step)
    drop_steps(d, 2)
    assert recorded_steps(d) == [0] and sorted(p.name for p in d.iterdir()) == ["0-0.npz"]
    drop_steps(tmp_path / "none", 0)  # a run without statistics: nothing made
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("damage", [b"garbage", None])
def test_a_damaged_chunk_is_an_error_naming_it(tmp_path, damage):
    d = tmp_path / "site_stats"
    write_chunk(d, [0, 1], [_packed(0), _packed(1)])
    p = d / "0-1.npz"
    p.write_bytes(damage if damage is not None else p.read_bytes()[:-40])  # garbage, truncated
    with pytest.raises(peat.PeatError, match=r"0-1\.npz cannot be read.*damaged"):
        read_step(d, 1)
    with pytest.raises(peat.PeatError, match=r"0-1\.npz cannot be read"):
        recorded_steps(d)


def test_runs_stored_one_file_a_step_still_compare(runs, tmp_path):
    """A run profiled before chunks (one `<step>.npz` a step; sites.json indented, one object a
    site, no `sample_density`) compares as it did; against a run sampled otherwise the comparison is
    refused."""
    old = {}
    for name in ("ref", "scaled"):
        old[name] = shutil.copytree(runs[name], tmp_path / name)
        d = RunDir(old[name]).site_stats
        for p in list(d.glob("*-*.npz")):
            with np.load(p, allow_pickle=False) as z:
                for t, step in enumerate(z["steps"]):
                    np.savez_compressed(d / f"{step}.npz", **{k: z[k][t] for k in
                                                              ("floats", "words", "sample")})
            p.unlink()
        sites = json.loads((d / "sites.json").read_text())
        fields = sites.pop("fields")
        entries = [dict(zip(fields, row)) for row in sites.pop("sites")]
        del sites["sample_density"]
        (d / "sites.json").write_text(json.dumps({**sites, "sites": entries}, indent=2))
    assert read_sites(RunDir(old["ref"]).site_stats) == read_sites(RunDir(runs["ref"]).site_stats)
    c, new = peat.compare(old["ref"], old["scaled"]), peat.compare(runs["ref"], runs["scaled"])
    assert (c.first_step, c.first_site, c.diagnosis) == (new.first_step, new.first_site,
                                                         new.diagnosis)
    assert c.grid == new.grid
    with pytest.raises(peat.PeatError, match="sampled the site outputs differently"):
        peat.compare(old["ref"], runs["scaled"])


@pytest.mark.slow
def test_a_resumed_run_keeps_sampling_as_it_began(tmp_path):
    """A run begun by an older peat_jax (every output sampled at min(n, 64) elements) goes on
    with its own sampling when resumed, so its sites.json describes every step it holds."""
    wl, run = _wl(), tmp_path / "run"
    profile(wl, run, steps=1, checkpoint_every=1, stats_every=1)
    d, older = RunDir(run).site_stats, Sampling(SAMPLE_SIZE, 1)
    state, batch = wl.init(jax.random.key(0)), jax.tree.map(jax.numpy.asarray, wl.batch(0))
    write_sites(d, StatsStep(wl.train_step, sampling=older).sites(state, batch), older)
    profile(wl, run, steps=2, checkpoint_every=1, stats_every=1)
    assert read_sampling(d) == older
    width = sum(s.sample_size for s in read_sites(d) if s.recorded)
    assert read_step(d, 1)["sample"].size == width > read_step(d, 0)["sample"].size
