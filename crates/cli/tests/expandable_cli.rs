//! `plan` on a GPU where fragmentation is what breaks the fit: DiT-XL/2 at 256², batch 28, on
//! an RTX 4090 (22.8 GiB usable). With PyTorch's default allocator the plan's recipe allocates
//! 22.0 GiB (+ 300 MiB context) but its cached segments need 23.2 GiB on the device; with
//! `expandable_segments:True` 22.3 GiB. The plan takes the setting, says why, and the export's
//! launch line sets it.

mod common;

use common::{argv, argv_with, json, temp_dir};

#[test]
fn plan_suggests_expandable_segments_where_fragmentation_breaks_the_fit() {
    let dir = temp_dir("expandable", "plan");
    let out_file = dir.join("accelerate_config.yaml");
    let v = json(&argv_with(
        "plan --preset dit-xl-2 --batch 28 --gpu rtx-4090 --json --emit accelerate --emit-out {}",
        &[out_file.to_str().unwrap()],
    ));
    assert_eq!(v["feasible"], true);
    assert_eq!(v["plan"]["cuda"]["alloc_conf"], "expandable_segments:True");
    let reason = v["reason"].as_str().unwrap();
    assert!(reason.contains("fragmentation breaks the fit"), "{reason}");
    assert!(v["predicted_peak_bytes"].as_u64() <= v["usable_bytes"].as_u64());
    let text = std::fs::read_to_string(&out_file).unwrap();
    assert!(
        text.contains("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True accelerate launch"),
        "{text}"
    );
    // Given by the user already: kept, and nothing more to suggest.
    let v = json(&argv(
        "plan --preset dit-xl-2 --batch 28 --gpu rtx-4090 --alloc-conf \
         expandable_segments:True --json",
    ));
    assert!(!v["reason"]
        .as_str()
        .unwrap()
        .contains("fragmentation breaks the fit"));
    let _ = std::fs::remove_dir_all(&dir);
}
