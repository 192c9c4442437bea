//! Issue 50: property tests of the latent reader (`load_latent_dir`, what `run --latents-dir`
//! reads): `.npy` files written from random latents read back as the same values, and `.npy`
//! headers mutated (shapes huge, zero, negative, of the wrong rank; dtypes; the header length;
//! versions; bytes flipped or cut) are read or refused with an error, never a panic.
//!
//! Bounded (256 and 128 cases, a fixed seed); `DITMEM_FUZZ_CASES=N` raises the counts.

use std::path::PathBuf;

use ditmem_budget::{ModelSpec, Precision, Spec};
use ditmem_engine::{load_latent_dir, SyntheticData};
use proptest::prelude::*;
use proptest::test_runner::TestRunner;

#[path = "common/fuzz_runner.rs"]
mod fuzz_runner;
use fuzz_runner::{fuzz_cases, fuzz_runner};

fn runner(default: u32) -> TestRunner {
    fuzz_runner(fuzz_cases(default), 256)
}

/// DiT-S/2 at 32², batch 1: latents of 4 × 4 × 4.
fn tiny() -> Spec {
    let mut s = Spec::default_xl();
    s.model = ModelSpec::preset("dit-s-2").unwrap();
    s.workload.height = 32;
    s.workload.width = 32;
    s.workload.batch = 1;
    s.workload.microbatch = 1;
    s.recipe.precision = Precision::Fp32;
    s
}

fn dir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ditmem-npy-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// An `.npy` file: magic, version, header length, the header dict padded to 64 bytes, data.
fn npy(header: &str, version: u8, declared_len: Option<u32>, data: &[u8]) -> Vec<u8> {
    let pre = if version == 1 { 10 } else { 12 };
    let mut h = header.as_bytes().to_vec();
    let pad = (64 - (pre + h.len() + 1) % 64) % 64;
    h.extend(std::iter::repeat_n(b' ', pad));
    h.push(b'\n');
    let mut b = b"\x93NUMPY".to_vec();
    b.extend([version, 0]);
    let n = declared_len.unwrap_or(h.len() as u32);
    if version == 1 {
        b.extend((n as u16).to_le_bytes());
    } else {
        b.extend(n.to_le_bytes());
    }
    b.extend(h);
    b.extend_from_slice(data);
    b
}

fn header(descr: &str, fortran: bool, shape: &str) -> String {
    format!(
        "{{'descr': '{descr}', 'fortran_order': {}, 'shape': {shape}, }}",
        if fortran { "True" } else { "False" }
    )
}

/// Latents written as `.npy` (f32 or f64, one or several files, 1–4 samples each) read back as
/// the same values, in file-name order.
#[test]
fn npy_latents_round_trip() {
    let spec = tiny();
    let data = SyntheticData::new(&spec, 0).unwrap();
    let d = dir("round-trip");
    let file = (1usize..=4, any::<bool>()).prop_flat_map(|(n, f64s)| {
        (
            Just(n),
            Just(f64s),
            prop::collection::vec(-1e6f64..1e6, n * 64),
        )
    });
    runner(128)
        .run(&prop::collection::vec(file, 1..4), |files| {
            for e in std::fs::read_dir(&d).unwrap() {
                std::fs::remove_file(e.unwrap().path()).unwrap();
            }
            let mut want: Vec<f64> = Vec::new();
            for (i, (n, f64s, vals)) in files.iter().enumerate() {
                let (descr, bytes): (&str, Vec<u8>) = if *f64s {
                    want.extend(vals);
                    ("<f8", vals.iter().flat_map(|v| v.to_le_bytes()).collect())
                } else {
                    want.extend(vals.iter().map(|v| *v as f32 as f64));
                    (
                        "<f4",
                        vals.iter()
                            .flat_map(|v| (*v as f32).to_le_bytes())
                            .collect(),
                    )
                };
                let h = header(descr, false, &format!("({n}, 4, 4, 4)"));
                std::fs::write(d.join(format!("{i:03}.npy")), npy(&h, 1, None, &bytes)).unwrap();
            }
            let b = load_latent_dir(&d, &data).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(b.n, want.len() / 64);
            prop_assert_eq!(b.latents, want);
            Ok(())
        })
        .unwrap();
    let _ = std::fs::remove_dir_all(&d);
}

/// Mutated `.npy` headers and files: read (then as many samples as the data holds) or refused
/// with an error, never a panic (nor an allocation sized by a header before it is checked).
#[test]
fn mutated_npy_files_are_read_or_refused() {
    let spec = tiny();
    let data = SyntheticData::new(&spec, 0).unwrap();
    let d = dir("mutated");
    let dimension = prop_oneof![
        6 => (0u64..5).prop_map(|v| v.to_string()),
        1 => Just(u64::MAX.to_string()),
        1 => Just((1u64 << 62).to_string()),
        1 => Just((1u64 << 31).to_string()),
        1 => Just("-1".to_string()),
        1 => Just("1.5".to_string()),
        1 => Just("None".to_string()),
        1 => Just("9".repeat(40)),
    ];
    let shape = prop::collection::vec(dimension, 0..6).prop_map(|dims| match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    });
    let descr = prop::sample::select(vec![
        "<f4", "<f8", "<f2", "<i8", "<i4", "|u1", "|b1", ">f4", "<c8", "|O", "<U4", "", "<f16",
    ]);
    let head = prop_oneof![
        6 => (descr, any::<bool>(), shape).prop_map(|(d, f, s)| header(d, f, &s)),
        1 => Just("{'descr': '<f4'}".to_string()),
        1 => Just("{'descr': lambda: 0, 'fortran_order': False, 'shape': (1,), }".to_string()),
        1 => Just("not a dict".to_string()),
        1 => "\\PC{0,40}",
    ];
    let strategy = (
        head,
        prop::sample::select(vec![1u8, 2, 3, 0, 9]),
        prop_oneof![4 => Just(None), 1 => any::<u32>().prop_map(Some)],
        0usize..1024,
        prop::collection::vec((any::<usize>(), any::<u8>()), 0..3),
        prop::option::of(any::<usize>()),
    );
    runner(256)
        .run(&strategy, |(h, version, declared, data_len, flips, cut)| {
            let mut b = npy(&h, version, declared, &vec![0u8; data_len]);
            for (i, x) in flips {
                let i = i % b.len();
                b[i] ^= x;
            }
            if let Some(c) = cut {
                b.truncate(c % (b.len() + 1));
            }
            std::fs::write(d.join("a.npy"), &b).unwrap();
            if let Ok(batch) = load_latent_dir(&d, &data) {
                prop_assert_eq!(batch.latents.len(), batch.n * 64);
            }
            Ok(())
        })
        .unwrap();
    let _ = std::fs::remove_dir_all(&d);
}
