"""Hold ditmem's exports against the real libraries, without starting any training.

For every plan folder under PLANS (made by run.sh: `ditmem plan … --emit TARGET --json` for the
four targets), this checks:

  yaml        accelerate_config.yaml through accelerate's own loader
              (accelerate.commands.config.config_args.load_config_from_file): every string value
              a str (PyYAML reads a plain `no` as False, which `accelerate launch` crashes on).
  acc-launch  the config-file launch line (`accelerate launch --config_file … SCRIPT …`) through
              accelerate's launch parser and `_validate_launch_command`, the fields accelerate then
              passes to DeepSpeed (as `launch_command` does), the environment its launcher would
              set (`prepare_deepspeed_cmd_env` / `prepare_multi_gpu_env` /
              `prepare_simple_launcher_cmd_env`), and the DeepSpeed or FSDP plugin built from that
              environment, as the training process builds it: the ZeRO stage / FSDP resharding
              must be the plan's, and for DeepSpeed the config filled as at world size `ranks`.
  ds@1,2,8    ds_config.json filled as accelerate fills it (DeepSpeedPlugin(hf_ds_config=…),
              set_mixed_precision, the values of accelerator.py `_prepare_deepspeed`) and built as
              `deepspeed.runtime.config.DeepSpeedConfig` at data-parallel world sizes 1, 2 and 8
              (the world size mocked in `deepspeed.runtime.config.dist`); no optimizer block
              (accelerate refuses one next to the script's optimizer); ZeRO-Offload with a client
              torch optimizer needs `zero_force_ds_cpu_optimizer` false (runtime/engine.py).
  alone       ds_config_standalone.json: DeepSpeedConfig accepts it at the plan's world size and
              refuses it at the others (fixed train_batch_size).
  diffusers   the diffusers launch line through the same launcher checks, and its script
              arguments through the script's own `parse_args` (vendored in vendor/diffusers_args/, read
              from diffusers v0.40.0): every flag accepted, and precision, microbatch,
              accumulation and LoRA rank parsed to the plan's values.

    python check.py PLANS [--json results.json]
"""

import argparse
import contextlib
import copy
import importlib.util
import io
import json
import logging
import os
import sys
import tempfile
import traceback
import types
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORLD_SIZES = (1, 2, 8)

logging.disable(logging.WARNING)
warnings.filterwarnings("ignore")
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="ditmem-eco-hf-"))

import accelerate  # noqa: E402
import deepspeed  # noqa: E402
import deepspeed.runtime.config as ds_config_mod  # noqa: E402
import diffusers  # noqa: E402
import torch  # noqa: E402
from accelerate.commands.config.config_args import load_config_from_file  # noqa: E402
from accelerate.commands.launch import _validate_launch_command, launch_command_parser  # noqa: E402
from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin  # noqa: E402
from accelerate.utils.launch import (  # noqa: E402
    prepare_deepspeed_cmd_env,
    prepare_multi_gpu_env,
    prepare_simple_launcher_cmd_env,
)

logging.disable(logging.WARNING)


class Failed(Exception):
    pass


def need(cond, msg):
    if not cond:
        raise Failed(msg)


@contextlib.contextmanager
def environ(env):
    """Run with exactly `env` as os.environ (what accelerate's launcher hands the process)."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def cwd(path):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


@contextlib.contextmanager
def world(size):
    """DeepSpeedConfig reads the data-parallel world size from deepspeed.comm; mock it."""
    real = ds_config_mod.dist
    ds_config_mod.dist = types.SimpleNamespace(get_rank=lambda: 0, get_world_size=lambda *a, **k: size)
    try:
        yield
    finally:
        ds_config_mod.dist = real


def quiet(fn, *a, **k):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return fn(*a, **k)


def deepspeed_env(args, defaults, mp_from_config):
    """The environment accelerate's launcher gives a DeepSpeed run (commands/launch.py
    launch_command: it first lists the config fields accelerate then checks)."""
    fields = list(defaults.deepspeed_config.keys()) if defaults else []
    if mp_from_config:
        fields.append("mixed_precision")
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    _, env = quiet(prepare_deepspeed_cmd_env, args)
    return env


def load_parser(script):
    path = HERE / "vendor" / "diffusers_args" / (Path(script).stem + ".py")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.parse_args


def expected_precision(recipe):
    return {"bf16-mixed": "bf16", "fp16-mixed": "fp16"}.get(recipe["precision"], "no")


def fill_like_accelerate(plugin, mp, micro, acc, world_size):
    """What accelerate does to a DeepSpeed config before deepspeed.initialize (1.15 state.py
    AcceleratorState → set_mixed_precision; accelerator.py _prepare_deepspeed: accumulation,
    config_kwargs, zero_allow_untested_optimizer for a torch optimizer)."""
    plugin.set_mixed_precision(mp)
    plugin.fill_match("gradient_accumulation_steps", must_match=False, gradient_accumulation_steps=acc)
    need("optimizer" not in plugin.deepspeed_config,
         "an optimizer block: accelerate refuses it next to the script's optimizer")
    plugin.deepspeed_config["zero_allow_untested_optimizer"] = True
    kwargs = {
        "gradient_clipping": 1.0,
        "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
        "train_micro_batch_size_per_gpu": micro,
        "train_batch_size": micro * plugin.get_value("gradient_accumulation_steps") * world_size,
    }
    plugin.deepspeed_config_process(must_match=False, **kwargs)
    return copy.deepcopy(plugin.deepspeed_config)


def build_ds(cfg, world_size, plan):
    """DeepSpeedConfig at `world_size`, held to the plan."""
    with world(world_size):
        c = quiet(ds_config_mod.DeepSpeedConfig, copy.deepcopy(cfg))
    r, w = plan["recipe"], plan["workload"]
    need(c.zero_optimization_stage == r["zero_stage"],
         f"ZeRO stage {c.zero_optimization_stage}, plan {r['zero_stage']}")
    need(c.train_micro_batch_size_per_gpu == w["microbatch"], "microbatch")
    need(c.gradient_accumulation_steps == w["accumulation"], "accumulation")
    need(c.train_batch_size == w["microbatch"] * w["accumulation"] * world_size, "train_batch_size")
    mp = expected_precision(r)
    need(bool(c.bfloat16_config.enabled) == (mp == "bf16"), f"bf16.enabled {c.bfloat16_config.enabled}")
    need(bool(c.float16_config.enabled) == (mp == "fp16"), f"fp16.enabled {c.float16_config.enabled}")
    off = c.zero_config.offload_optimizer
    if "optimizer" not in cfg and off is not None and str(off.device).endswith(("cpu", "nvme")):
        # runtime/engine.py _configure_basic_optimizer: a client torch optimizer under
        # ZeRO-Offload is refused unless zero_force_ds_cpu_optimizer is false.
        need(not c.zero_force_ds_cpu_optimizer, "ZeRO-Offload with torch AdamW needs zero_force_ds_cpu_optimizer false")
    return c


def check_launch(cmd, plan, options, workdir):
    """accelerate's launch validation and the plugin its launcher's environment builds."""
    # A launch line may start with environment assignments (`PYTORCH_CUDA_ALLOC_CONF=…` when
    # the plan needs expandable segments): a shell sets them for the launcher.
    launcher = list(cmd["launcher"])
    while launcher and "=" in launcher[0] and launcher[0].split("=", 1)[0].isidentifier():
        name, value = launcher.pop(0).split("=", 1)
        need(name == "PYTORCH_CUDA_ALLOC_CONF", f"unexpected environment variable {name}")
        for item in value.split(","):
            key, _, val = item.partition(":")
            need(key in ("expandable_segments", "max_split_size_mb", "roundup_power2_divisions",
                         "garbage_collection_threshold") and val != "",
                 f"PYTORCH_CUDA_ALLOC_CONF item {item!r}")
    need(launcher[:2] == ["accelerate", "launch"], f"launcher {launcher[:2]}")
    argv = launcher[2:] + [cmd["script"]] + cmd["script_args"]
    with cwd(workdir):
        args = launch_command_parser().parse_args(argv)
        args, defaults, mp_from_config = quiet(_validate_launch_command, args)
        r, w = plan["recipe"], plan["workload"]
        mp = expected_precision(r)
        need(args.mixed_precision == mp, f"mixed_precision {args.mixed_precision!r}, plan {mp}")
        need(int(args.num_processes) == w["ranks"], f"num_processes {args.num_processes}")
        z = r["zero_stage"]
        if args.use_deepspeed:
            env = deepspeed_env(args, defaults, mp_from_config)
        elif args.use_fsdp or args.multi_gpu:
            env = quiet(prepare_multi_gpu_env, args)
        else:
            _, env = quiet(prepare_simple_launcher_cmd_env, args)
        with environ(env):
            if z > 0 and options["sharder"] == "deepspeed":
                need(args.use_deepspeed and not args.multi_gpu, "a ZeRO plan must launch DeepSpeed")
                plugin = quiet(DeepSpeedPlugin)
                need(plugin.zero_stage == z, f"DeepSpeed starts ZeRO stage {plugin.zero_stage}, plan {z}")
                cfg = fill_like_accelerate(plugin, env["ACCELERATE_MIXED_PRECISION"], w["microbatch"],
                                           w["accumulation"], w["ranks"])
                build_ds(cfg, w["ranks"], plan)
                return f"DeepSpeed ZeRO-{plugin.zero_stage}"
            if z > 0:
                need(args.use_fsdp and not args.use_deepspeed, "an FSDP plan must launch FSDP")
                plugin = quiet(FullyShardedDataParallelPlugin)
                need(plugin.fsdp_version == 2, f"fsdp_version {plugin.fsdp_version}")
                need(plugin.reshard_after_forward == (z == 3), f"reshard_after_forward {plugin.reshard_after_forward}")
                offload = options["offload"] == "optimizer+params"
                # FSDP2 (torch.distributed.fsdp): CPUOffloadPolicy offloads, OffloadPolicy() does not.
                kind = type(plugin.cpu_offload).__name__
                need((kind == "CPUOffloadPolicy") == offload, f"cpu_offload {kind}")
                return f"FSDP2 reshard={plugin.reshard_after_forward}"
            need(not args.use_deepspeed and not args.use_fsdp, "an unsharded plan must not shard")
            need(args.multi_gpu == (w["ranks"] > 1), f"multi_gpu {args.multi_gpu}")
            return "DDP" if args.multi_gpu else "one process"


def check_script(cmd, plan):
    if cmd["script_source"] is None:
        need(not cmd["script_args"], "flags for a placeholder script")
        return "no script (note)"
    parse = load_parser(cmd["script"])
    a = quiet(parse, list(cmd["script_args"]))
    r, w = plan["recipe"], plan["workload"]
    need(a.mixed_precision == expected_precision(r), f"script --mixed_precision {a.mixed_precision}")
    launcher = cmd["launcher"]
    need(a.mixed_precision == launcher[launcher.index("--mixed_precision") + 1], "script and launcher precision differ")
    need(a.train_batch_size == w["microbatch"], f"--train_batch_size {a.train_batch_size}")
    need(a.gradient_accumulation_steps == w["accumulation"], "--gradient_accumulation_steps")
    if r.get("lora"):
        need(a.rank == r["lora"]["rank"], f"--rank {a.rank}")
        mods = r["lora"].get("modules") or []
        if mods:
            need(a.lora_layers == ",".join(mods), f"--lora_layers {a.lora_layers}")
    # Every field of the recipe the script has a flag for is realised by its flags.
    need(bool(a.gradient_checkpointing) == (r["recompute"] == "all"),
         f"--gradient_checkpointing {a.gradient_checkpointing}, recompute {r['recompute']}")
    need(r["recompute"] in ("none", "all"), f"recompute {r['recompute']}: no flag")
    need(bool(a.use_8bit_adam) == (r["optimizer"] == "adamw-8bit"), "--use_8bit_adam")
    need(bool(getattr(a, "cache_latents", False)) == (r["latents"] == "cached"),
         f"--cache_latents, latents {r['latents']}")
    need(not r.get("base_quant"), f"base {r.get('base_quant')}: no flag")
    need(bool(getattr(a, "offload", False)) == (r.get("text_encoders") == "offloaded"), "--offload")
    need(a.resolution == max(w["height"], w["width"]), f"--resolution {a.resolution}")
    # recipe.tf32 (absent: on) is --allow_tf32.
    need(bool(a.allow_tf32) == r.get("tf32", True), f"--allow_tf32 {a.allow_tf32}, tf32 {r.get('tf32', True)}")
    # The workload's text tokens: the scripts pad T5's (Flux, SD3: the second stream) and
    # Gemma's (Sana: the only one) to --max_sequence_length; CLIP's 77 are fixed
    # (tokenizer max_length=77). The plan counts workload.text_tokens when it has them.
    tokens = w.get("text_tokens")
    if tokens and hasattr(a, "max_sequence_length"):
        stream = 0 if len(tokens) == 1 else 1
        need(a.max_sequence_length == tokens[stream],
             f"--max_sequence_length {a.max_sequence_length}, plan's text tokens {tokens}")
    return f"{cmd['script']} ok"


def run_check(fn):
    try:
        return True, fn()
    except Failed as e:
        return False, str(e)
    except SystemExit as e:  # argparse refused an argument
        return False, f"argparse exit {e.code}"
    except Exception as e:  # a library refused it
        return False, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def load_reports(folder):
    """One `ditmem plan --emit accelerate,deepspeed,deepspeed-standalone,diffusers --json`: the
    plan with each export, as the per-target reports the checks read."""
    single = folder / "plan.json"
    if single.exists():
        p = json.loads(single.read_text())
        return {e["target"]: {**p, "export": e} for e in p["exports"]}
    return {t: json.loads((folder / f"{t}.json").read_text()) for t in
            ("accelerate", "deepspeed", "deepspeed-standalone", "diffusers")}


def check_plan(folder, reports=None):
    reports = reports or load_reports(folder)
    plan = reports["accelerate"]["plan"]
    options = reports["accelerate"]["export"]["options"]
    out = {"plan": folder.name, "precision": plan["recipe"]["precision"], "ranks": plan["workload"]["ranks"],
           "zero": plan["recipe"]["zero_stage"], "sharder": options["sharder"], "offload": options["offload"],
           "family": options["family"], "lora": bool(plan["recipe"].get("lora")), "checks": {}}
    work = Path(tempfile.mkdtemp(prefix="ditmem-eco-"))
    for t in ("accelerate", "deepspeed", "deepspeed-standalone"):
        e = reports[t]["export"]
        (work / e["file_name"]).write_text(e["text"])
    for t in reports:
        need(reports[t]["plan"] == plan, f"{t}: another plan")

    def yaml_check():
        c = load_config_from_file(str(work / "accelerate_config.yaml"))
        for k in ("mixed_precision", "downcast_bf16", "main_training_function", "rdzv_backend", "gpu_ids"):
            v = getattr(c, k, None)
            need(v is None or isinstance(v, str), f"{k} read as {v!r}")
        return f"{c.distributed_type.value}"

    out["checks"]["yaml"] = run_check(yaml_check)
    out["checks"]["acc-launch"] = run_check(lambda: check_launch(reports["accelerate"]["export"]["command"], plan, options, work))
    for ws in WORLD_SIZES:
        def ds_check(ws=ws):
            with environ({k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}):
                plugin = quiet(DeepSpeedPlugin, hf_ds_config=str(work / "ds_config.json"), zero3_init_flag=False)
                cfg = fill_like_accelerate(plugin, expected_precision(plan["recipe"]), plan["workload"]["microbatch"],
                                           plan["workload"]["accumulation"], ws)
            build_ds(cfg, ws, plan)
            return "ok"
        out["checks"][f"ds@{ws}"] = run_check(ds_check)

    def alone():
        cfg = json.loads((work / "ds_config_standalone.json").read_text())
        need("auto" not in json.dumps(cfg), "\"auto\" in the standalone config")
        ranks = plan["workload"]["ranks"]
        build_ds(cfg, ranks, plan)
        refused = []
        for ws in WORLD_SIZES:
            if ws == ranks:
                continue
            try:
                with world(ws):
                    quiet(ds_config_mod.DeepSpeedConfig, copy.deepcopy(cfg))
            except Exception:
                refused.append(ws)
        need(len(refused) == len([w for w in WORLD_SIZES if w != ranks]), f"accepted at another world size: refused only {refused}")
        return f"ok at {ranks}, refused at {refused}"

    out["checks"]["alone"] = run_check(alone)

    def yaml_alone():
        """`accelerate launch --config_file accelerate_config.yaml train.py`: no precision on
        the line; what accelerate then trains in must be the plan's."""
        c = reports["accelerate"]["export"]["command"]
        argv = ["--config_file", "accelerate_config.yaml", c["script"]]
        mp = expected_precision(plan["recipe"])
        with cwd(work):
            args = launch_command_parser().parse_args(argv)
            args, defaults, mp_from_config = quiet(_validate_launch_command, args)
            if args.use_deepspeed:
                env = deepspeed_env(args, defaults, mp_from_config)
                with environ(env):
                    plugin = quiet(DeepSpeedPlugin)
                    # The precision DeepSpeed runs: the JSON's, once accelerate fills it with the
                    # launch's (ACCELERATE_MIXED_PRECISION; fill_match refuses a mismatch).
                    cfg = fill_like_accelerate(plugin, env.get("ACCELERATE_MIXED_PRECISION", "no"),
                                               plan["workload"]["microbatch"], plan["workload"]["accumulation"],
                                               plan["workload"]["ranks"])
                got = "bf16" if cfg.get("bf16", {}).get("enabled") is True else \
                      "fp16" if cfg.get("fp16", {}).get("enabled") is True else "no"
                need(got == mp, f"DeepSpeed trains in {got}, plan {mp}")
                return f"DeepSpeed {got}"
            need(args.mixed_precision == mp, f"YAML alone: mixed_precision {args.mixed_precision!r}, plan {mp}")
            return f"mixed_precision {args.mixed_precision}"

    out["checks"]["yaml-alone"] = run_check(yaml_alone)

    def files():
        d = folder / "files"
        if not d.exists():
            return "no --emit-dir"
        names = sorted(p.name for p in d.iterdir())
        text = (d / "accelerate_config.yaml").read_text()
        if "deepspeed_config_file" in text:
            need("ds_config.json" in names, "the YAML names ds_config.json, not written")
        for py in d.glob("*.py"):
            compile(py.read_text(), str(py), "exec")
        return ",".join(names)

    out["checks"]["files"] = run_check(files)
    cmd = reports["diffusers"]["export"]["command"]
    out["checks"]["diffusers"] = run_check(lambda: check_launch(cmd, plan, options, work) + "; " + check_script(cmd, plan))
    out["script"] = cmd["script"]
    return out


def _mutants():
    """The bugs of issue 17, planted back into good exports: each must fail a check."""

    def unquoted(r):
        e = r["accelerate"]["export"]
        e["text"] = e["text"].replace("mixed_precision: 'no'", "mixed_precision: no")

    def yaml_repeats_json_keys(r):
        e = r["accelerate"]["export"]
        e["text"] = e["text"].replace("  zero3_init_flag: false\n",
                                      "  zero3_init_flag: false\n  gradient_accumulation_steps: 4\n  zero_stage: 3\n")

    def yaml_mixed_precision_beside_json(r):
        e = r["accelerate"]["export"]
        e["text"] = e["text"] + "mixed_precision: 'bf16'\n"
        launcher = e["command"]["launcher"]
        i = launcher.index("--mixed_precision")
        del launcher[i:i + 2]

    def optimizer_block(r):
        e = r["deepspeed"]["export"]
        v = json.loads(e["text"])
        v["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4}}
        e["text"] = json.dumps(v)

    def fixed_batch(r):
        e = r["deepspeed"]["export"]
        v = json.loads(e["text"])
        w = r["deepspeed"]["plan"]["workload"]
        v["train_batch_size"] = w["batch"]
        e["text"] = json.dumps(v)

    def multi_gpu(r):
        c = r["diffusers"]["export"]["command"]
        c["launcher"] = ["accelerate", "launch", "--multi_gpu", "--num_processes", "8", "--mixed_precision", "bf16"]

    def use_ema(r):
        r["diffusers"]["export"]["command"]["script_args"].append("--use_ema")

    def offload_without_force_false(r):
        e = r["deepspeed"]["export"]
        v = json.loads(e["text"])
        v.pop("zero_force_ds_cpu_optimizer", None)
        e["text"] = json.dumps(v)

    def auto_precision(r):
        e = r["deepspeed"]["export"]
        cfg = json.loads(e["text"])
        cfg["bf16"]["enabled"] = "auto"
        cfg["fp16"]["enabled"] = "auto"
        e["text"] = json.dumps(cfg)

    def no_tf32(r):
        args = r["diffusers"]["export"]["command"]["script_args"]
        args.remove("--allow_tf32")

    def t5_tokens_dropped(r):
        r["diffusers"]["plan"]["workload"]["text_tokens"] = [77, 256]
        for t in r:
            r[t]["plan"] = r["diffusers"]["plan"]

    return [
        ("fp32-1-dit", "mixed_precision: no (unquoted)", unquoted, "yaml"),
        ("zero3-8-flux", "YAML repeats the JSON's keys", yaml_repeats_json_keys, "acc-launch"),
        ("zero3-8-flux", "YAML mixed_precision beside the JSON", yaml_mixed_precision_beside_json, "acc-launch"),
        ("zero3-8-flux", "optimizer block in ds_config.json", optimizer_block, "ds@8"),
        ("zero3-8-flux", "fixed train_batch_size", fixed_batch, "ds@1"),
        ("zero3-8-flux", "--multi_gpu for a ZeRO-3 plan", multi_gpu, "diffusers"),
        ("zero3-8-flux", "--use_ema to train_dreambooth_flux.py", use_ema, "diffusers"),
        ("zero3-8-flux", "\"auto\" precision in ds_config.json (issue 46)", auto_precision, "yaml-alone"),
        ("lora-1-sd35", "--allow_tf32 dropped (recipe.tf32 on)", no_tf32, "diffusers"),
        ("lora-targets-1-flux", "T5 tokens 256 planned, --max_sequence_length not passed", t5_tokens_dropped, "diffusers"),
        ("zero2-offload-8-flux", "ZeRO-Offload without zero_force_ds_cpu_optimizer false", offload_without_force_false, "ds@2"),
    ]


def run_mutants(plans):
    caught = 0
    mutants = _mutants()
    print("\nthe bugs planted back (each must fail the named check):\n")
    print("| plan | planted bug | check | result |")
    print("|---|---|---|---|")
    for name, what, mutate, check in mutants:
        reports = load_reports(plans / name)
        mutate(reports)
        r = check_plan(plans / name, reports)
        ok, msg = r["checks"][check]
        caught += not ok
        print(f"| {name} | {what} | {check} | {'caught: ' + msg[:110] if not ok else 'NOT CAUGHT'} |")
    print(f"\n{caught} of {len(mutants)} planted bugs caught")
    return caught == len(mutants)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("plans", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--mutants", action="store_true", help="also plant the issue's bugs back and require each caught")
    a = ap.parse_args()
    versions = {"accelerate": accelerate.__version__, "deepspeed": deepspeed.__version__,
                "diffusers": diffusers.__version__, "torch": torch.__version__,
                "python": sys.version.split()[0]}
    rows = []
    for folder in sorted(p for p in a.plans.iterdir() if p.is_dir()):
        try:
            rows.append(check_plan(folder))
        except Exception:
            traceback.print_exc()
            rows.append({"plan": folder.name, "checks": {"load": (False, "could not read the plan")}})
    names = ["yaml", "acc-launch"] + [f"ds@{w}" for w in WORLD_SIZES] + ["alone", "yaml-alone", "files", "diffusers"]
    print("libraries: " + ", ".join(f"{k} {v}" for k, v in versions.items())
          + "; diffusers scripts: v0.40.0 (d035dcd7cc7c88e0a154609b62887d50bba9fdc2), vendored parse_args")
    print()
    print("| plan | precision | ranks | sharding | offload | family | script | " + " | ".join(names) + " |")
    print("|" + "---|" * (7 + len(names)))
    failures = []
    for r in rows:
        shard = "none" if not r.get("zero") else (f"ZeRO-{r['zero']}" if r["sharder"] == "deepspeed" else f"FSDP2 ({r['zero']})")
        cells = []
        for n in names:
            ok, msg = r["checks"].get(n, (False, "not run"))
            cells.append("pass" if ok else "FAIL")
            if not ok:
                failures.append(f"{r['plan']} {n}: {msg}")
        print(f"| {r['plan']} | {r.get('precision', '')} | {r.get('ranks', '')} | {shard} | {r.get('offload', '')} | "
              f"{r.get('family', '')} | {r.get('script', '')} | " + " | ".join(cells) + " |")
    print()
    passed = sum(ok for r in rows for ok, _ in r["checks"].values())
    total = sum(len(r["checks"]) for r in rows)
    for f in failures:
        print("FAIL", f)
    print(f"{len(rows)} plans: {passed} passed, {total - passed} failed")
    if a.json:
        a.json.write_text(json.dumps({"versions": versions, "rows": rows}, indent=1) + "\n")
    mutants_ok = run_mutants(a.plans) if a.mutants else True
    sys.exit(0 if passed == total and mutants_ok else 1)


if __name__ == "__main__":
    main()
