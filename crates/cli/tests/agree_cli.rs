//! `ditmem agree` on both bf16 product paths: the AVX512-BF16 kernel where this CPU has it, and
//! the widening path forced with `DITMEM_BF16_GEMM=widen` (the path of CPUs without it). Each
//! process decides its path once, so the forced run is a child process; the budget follows the
//! same decision, and the grid must stay within 1 % either way (the bound is 2 %; it measures 0.43 %).

use std::process::Command;

fn agree_max_error(widen: bool) -> (f64, u64) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ditmem"));
    cmd.args(["agree", "--every", "3", "--json"]);
    if widen {
        cmd.env("DITMEM_BF16_GEMM", "widen");
    } else {
        cmd.env_remove("DITMEM_BF16_GEMM");
    }
    let out = cmd.output().expect("the binary runs");
    assert!(
        out.status.success(),
        "agree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("agree --json is JSON");
    let s = &v["summary"];
    (
        s["max_abs_rel_error"].as_f64().expect("max_abs_rel_error"),
        s["specs"].as_u64().expect("specs"),
    )
}

#[test]
fn grid_agrees_on_both_bf16_product_paths() {
    for widen in [false, true] {
        let (max, specs) = agree_max_error(widen);
        assert!(specs >= 14, "widen {widen}: only {specs} specs ran");
        assert!(max < 0.01, "widen {widen}: max |pred/meas − 1| = {max}");
    }
}
