"""`peat check`: a bundled, dot_general or any kernel against its reference, or lowered for
GPUs."""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import peat_jax as peat
from peat_jax._src import kernel_spec
from peat_jax._src.check import check_kernel
from peat_jax._src.cli.inputs import KERNELS, REGION_KERNELS
from peat_jax._src.cli.output import diag_json, esc, print_json, rich_console, say
from peat_jax._src.errors import PeatError


def check_seeds(args) -> list[int]:
    """The seeds `peat check` runs: --seed, or --seed .. --seed + N - 1 with --seeds N."""
    return list(range(args.seed, args.seed + (args.seeds or 1)))


def run_checks(args, candidate, reference,
                args_at: Callable[[int], tuple]) -> list[tuple[int, Any]]:
    """`check_kernel` once per seed: [(seed, Diagnosis)], the example args drawn by
    `args_at(seed)` and the variants seeded by it too."""
    out = []
    for seed in check_seeds(args):
        xs = args_at(seed)
        out.append((seed, check_kernel(candidate, reference, *xs, allow=tuple(args.allow or ()),
                                       variants=kernel_spec.parse_variants(args.variants),
                                       seed=seed, reference_precision=args.reference_precision,
                                       conditioning=args.conditioning)))
    return out


def report_checks(args, results: list[tuple[int, Any]], extra: Optional[dict] = None) -> int:
    """Prints the verdicts (a JSON object under --json: the first failing seed's diagnosis, or
    the first seed's, with "seeds" listing each with --seeds); 0 when every seed passed."""
    passed = all(d.passed for _, d in results)
    seed, shown = next(((s, d) for s, d in results if not d.passed), results[0])
    if args.json:
        obj = {**diag_json(shown), "passed": passed, **(extra or {})}
        if args.seeds is not None:
            obj["seed"] = seed
            obj["seeds"] = [{"seed": s, **diag_json(d)} for s, d in results]
        print_json(args, obj, default=repr)
        return 0 if passed else 1
    for s, d in results:
        style = "green" if d.passed else "red"
        prefix = f"seed {s}: " if len(results) > 1 else ""
        say(args, f"[{style}]{prefix}{esc(d.summary)}[/]")
    if len(results) > 1:
        say(args, f"evidence of seed {seed}:")
    for k, v in shown.evidence.items():
        say(args, f"  {k}: {esc(v)}")
    return 0 if passed else 1


def cmd_check(args) -> int:
    if args.reference is not None:
        return check_any(args)
    for opt in ("config", "int_bound", "kernel_kwargs", "reference_kwargs"):
        if getattr(args, opt) is not None:
            raise PeatError(f"--{opt.replace('_', '-')} needs --reference (the function to check "
                            "the kernel against)")
    region = REGION_KERNELS.get(args.kernel)
    if region:
        kernel = region[0]()
    elif args.kernel in KERNELS:
        kernel = KERNELS[args.kernel]()
    elif ":" in args.kernel or "." in args.kernel:
        loaded = kernel_spec.as_function(kernel_spec.load(args.kernel, "kernel"), args.kernel)
        if not isinstance(loaded, peat.Kernel):
            raise PeatError(f"{args.kernel!r} is a function, not a dot_general peat.Kernel: give "
                            f"--reference REF to check it against (REF as "
                            f"{kernel_spec.SPEC_FORMS})")
        kernel = loaded
    else:
        raise PeatError(f"unknown kernel {args.kernel!r}; bundled kernels: "
                        f"{', '.join([*KERNELS, *REGION_KERNELS])}; or check any function with "
                        f"--reference (KERNEL as {kernel_spec.SPEC_FORMS})")
    shapes = kernel_spec.parse_shapes(args.shapes or (region[2] if region else "67x45,45x33"))
    dtypes = kernel_spec.parse_dtypes(args.dtypes, len(shapes))
    dtype = dtypes[0]
    if len(set(dtypes)) != 1 or dtype.name not in ("float32", "bfloat16", "float16"):
        raise PeatError(f"bundled and dot_general kernels take one float dtype for all operands "
                        f"(float32, bfloat16 or float16), got --dtypes {args.dtypes!r}")

    def draw(seed: int) -> tuple:    # on the host: a jax draw compiles per shape
        return tuple(jax.device_put(x) for x in kernel_spec.draw_args(shapes, dtypes, seed))

    if region:
        reference, candidate = region[1], kernel
        n_args = {"pallas_softmax": 1, "pallas_layer_norm": 3, "pallas_attention": 3}[args.kernel]
        if len(shapes) != n_args:
            raise PeatError(f"{args.kernel} takes {n_args} operand(s); --shapes gave "
                            f"{len(shapes)} (default {region[2]})")
    else:
        if kernel.primitive == "dot_general" and len(shapes) != 2:
            raise PeatError(f"{args.kernel} multiplies two operands: --shapes takes two shapes "
                            f"like 67x45,45x33 (MxK,KxN), got {len(shapes)} ({args.shapes!r})")
        if kernel.primitive != "dot_general":
            raise PeatError(f"kernel {kernel.name!r} serves {kernel.primitive!r}, not "
                            f"dot_general: give --reference REF to check it against (REF as "
                            f"{kernel_spec.SPEC_FORMS})")
        dims = (((len(shapes[0]) - 1,), (0,)), ((), ()))
        params = {"dimension_numbers": dims, "precision": None, "preferred_element_type": dtype}

        # jitted, so the variants of one shape share one compiled program (eager, a Pallas
        # kernel compiles again at every call); its result follows its inputs' dtype (here
        # `dtype`), so that it also runs in float64 and sets the float64 noise floor
        @jax.jit
        def reference(a, b):
            return jax.lax.dot_general(a, b, dims)

        @jax.jit
        def candidate(a, b):
            return kernel(a, b, **params)

    if args.lower:
        # lowering only: the kernel, forward and backward, built compiled for each GPU
        fn = kernel if region else (lambda a, b: kernel(a, b, **params))
        return check_lowering(args, kernel.name, fn, draw(check_seeds(args)[0]))
    return report_checks(args, run_checks(args, candidate, reference, draw))


def check_any(args) -> int:
    """`peat check KERNEL --reference REF`: any function against any reference, on operands
    drawn from --shapes/--dtypes (or given by a --config spec), kwargs from --config."""
    fn: Callable[..., Any]
    if args.kernel in REGION_KERNELS:
        fn = REGION_KERNELS[args.kernel][0]()
    elif args.kernel in KERNELS:
        fn = KERNELS[args.kernel]()
    elif ":" in args.kernel or "." in args.kernel:
        fn = kernel_spec.as_function(kernel_spec.load(args.kernel, "kernel"), args.kernel)
    else:
        raise PeatError(f"unknown kernel {args.kernel!r}; bundled kernels: "
                        f"{', '.join([*KERNELS, *REGION_KERNELS])}, or give "
                        f"{kernel_spec.SPEC_FORMS}")
    ref = kernel_spec.as_function(kernel_spec.load(args.reference, "reference"), args.reference,
                                  "reference")
    first = check_seeds(args)[0]
    config = kernel_spec.parse_config(args.config, first)
    if config.args is not None:
        if args.shapes is not None or args.dtypes is not None or args.int_bound is not None:
            raise PeatError(f"--config {args.config!r} returned the example args: leave out "
                            "--shapes, --dtypes and --int-bound (or return only \"kwargs\")")
        shapes = dtypes = None
    elif args.shapes is None:
        raise PeatError("give --shapes, one per operand (like 2x128x4x64,2x128x4x64,2x128x4x64; "
                        "() for a scalar), or a --config MOD:SPEC returning the example args")
    else:
        shapes = kernel_spec.parse_shapes(args.shapes)
        dtypes = kernel_spec.parse_dtypes(args.dtypes, len(shapes))

    drawn: dict[int, tuple] = {}

    def args_at(seed: int) -> tuple:
        if seed not in drawn:
            if shapes is None:
                got = config if seed == first else kernel_spec.parse_config(args.config, seed)
                if got.args is None:
                    raise PeatError(f"--config {args.config!r} returned no \"args\" for seed "
                                    f"{seed} (it did for seed {first}); return them every time")
                drawn[seed] = got.args
            else:
                assert dtypes is not None  # parsed together with shapes
                drawn[seed] = tuple(jax.device_put(x) for x in
                                    kernel_spec.draw_args(shapes, dtypes, seed, args.int_bound))
        return drawn[seed]

    kwargs = {**config.kwargs, **kernel_spec.parse_kwargs(args.kernel_kwargs, "--kernel-kwargs")}
    ref_kwargs = {**config.kwargs,
                  **kernel_spec.parse_kwargs(args.reference_kwargs, "--reference-kwargs")}
    # the candidate jitted (its kwargs static), so that the variants of one shape share one
    # compiled program; the reference runs as given
    candidate = jax.jit(functools.partial(fn, **kwargs)) if kwargs else jax.jit(fn)
    reference = functools.partial(ref, **ref_kwargs) if ref_kwargs else ref
    if args.lower:
        bound = functools.partial(fn, **kwargs)
        return check_lowering(args, args.kernel, bound, args_at(first))
    results = run_checks(args, candidate, reference, args_at)
    extra = {"candidate": args.kernel, "reference": args.reference,
             "operands": kernel_spec.describe_args(args_at(first)), "kwargs": kwargs}
    if ref_kwargs != kwargs:
        extra["reference_kwargs"] = ref_kwargs
    return report_checks(args, results, extra)


def check_lowering(args, name: str, fn: Callable, xs) -> int:
    """`peat check --lower`: one line per (platform, device), its forward and its VJP lowered
    for that GPU on this machine; 1 when one failed."""
    from peat_jax._src.lowering import lowers_for
    results = lowers_for(fn, *xs, platforms=args.lower, grad=True, name=name)
    by_target: dict[tuple[str, str], list] = {}
    for r in results:
        by_target.setdefault((r.platform, r.device), []).append(r)
    ok = all(r.ok for r in results)
    if args.json:
        print_json(args, {"kernel": name, "ok": ok, "jax": jax.__version__,
                           "lowerings": [r.to_dict() for r in results]})
        return 0 if ok else 1
    console = rich_console()

    def say(msg: str) -> None:   # one line per GPU however long jax's message
        console.print(msg, soft_wrap=True)

    for (platform, device), rs in by_target.items():
        failed = [r for r in rs if not r.ok]
        where = f"{platform} {esc(device)}: {esc(name)}"
        if failed:
            say(f"[red]{where} FAILED ({failed[0].phase}): {esc(failed[0].error)}[/]")
        else:
            n = max(len(r.kernels) for r in rs)
            say(f"[green]{where} lowers[/] ({' and '.join(r.phase for r in rs)}; {n} "
                f"Pallas kernel{'' if n == 1 else 's'})")
    for w in dict.fromkeys(w for r in results for w in r.warnings):
        say(f"[yellow]jax warned: {esc(w)}[/]")
    if any(r.kernels for r in results) and not results[0].device_used:
        say(f"(jax {jax.__version__} without a GPU lowers Triton kernels for compute "
            "capability 9.0 whatever the device kind)")
    return 0 if ok else 1
