//! `ditmem params` as a user runs it: presets, a config.json or its folder, `--weights` against
//! safetensors headers, JSON fields, and bad input (exit 2, one line naming the key or flag).

mod common;

use std::path::{Path, PathBuf};

use common::{argv_with, ditmem, exits_naming, json_of, temp_dir};
use serde_json::{json, Value};

fn saved(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../budget/tests/data/saved_configs")
        .join(format!("{name}.json"))
}

#[test]
fn presets_print_diffusers_counts_and_state() {
    // Counts of the diffusers classes (bench/torch_peer/count_params.py, diffusers 0.42.1).
    for (preset, total, family) in [
        ("flux.1-dev", 11_901_408_320u64, "flux"),
        ("sd3.5-large", 8_056_627_520, "sd3"),
        ("pixart-sigma-1024", 610_856_096, "pixart"),
        ("sana-1600m", 1_604_462_752, "sana"),
        ("wan2.1-1.3b", 1_418_996_800, "wan"),
        ("dit-xl-2-256", 749_826_464, "dit-diffusers"),
        ("dit-xl-2", 675_129_632, "dit"),
    ] {
        let v = json_of(&["params", "--preset", preset]);
        assert_eq!(v["params"]["total"], total, "{preset}");
        assert_eq!(v["model"]["family"], family, "{preset}");
        let sum: u64 = v["params"]["per_group"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g["parameters"].as_u64().unwrap())
            .sum();
        assert_eq!(sum, total, "{preset}: groups add up");
        let state = v["state"].as_array().unwrap();
        let buffers = v["params"]["buffers"].as_u64().unwrap();
        assert_eq!(state[0]["recipe"], "bf16-weights");
        assert_eq!(state[0]["bytes"], 2 * (total + buffers));
        let trainable = v["params"]["trainable"].as_u64().unwrap();
        assert_eq!(
            state[2]["bytes"],
            16 * trainable + 4 * (total - trainable + buffers)
        );
        assert!(v["note"].as_str().unwrap().contains("ditmem estimate"));
    }
    let (code, out, _) = ditmem(&["params", "--preset", "sd3.5-medium"]);
    assert_eq!(code, 0);
    assert!(out.contains("SD3Transformer2DModel (family sd3)"), "{out}");
    assert!(out.contains("2,243,171,520"), "{out}");
    assert!(
        out.contains("226,492,416"),
        "the position buffer apart: {out}"
    );
    assert!(out.contains("activations"), "{out}");
}

#[test]
fn model_reads_a_config_or_its_folder() {
    let v = json_of(&[
        "params",
        "--model",
        saved("flux.1-schnell").to_str().unwrap(),
    ]);
    assert_eq!(v["params"]["total"], 11_891_178_560u64);
    let dir = temp_dir("params", "folder");
    std::fs::copy(saved("wan2.1-14b"), dir.join("config.json")).unwrap();
    let v = json_of(&["params", "--model", dir.to_str().unwrap()]);
    assert_eq!(v["params"]["total"], 14_288_491_584u64);
    assert_eq!(v["params"]["buffers"], 262_144);
    assert_eq!(v["model"]["dims"]["num_layers"], 40);
}

#[test]
fn bad_input_exits_2_naming_the_key_or_flag() {
    let dir = temp_dir("params", "bad");
    let cases: Vec<(&str, String, &str)> = vec![
        (
            "bad.json",
            r#"{"_class_name": "FluxTransformer2DModel", "num_layers": -3}"#.into(),
            "key 'num_layers'",
        ),
        (
            "unet.json",
            r#"{"_class_name": "UNet2DConditionModel"}"#.into(),
            "key '_class_name'",
        ),
        (
            "mismatch.json",
            r#"{"_class_name": "SanaTransformer2DModel", "cross_attention_dim": 2304}"#.into(),
            "key 'cross_attention_dim'",
        ),
        ("broken.json", "{".into(), "not valid JSON"),
        ("big.json", " ".repeat(2 << 20), "larger than"),
    ];
    for (file, text, needle) in cases {
        let p = dir.join(file);
        std::fs::write(&p, text).unwrap();
        let (code, out, err) = ditmem(&["params", "--model", p.to_str().unwrap()]);
        assert_eq!(code, 2, "{file}: {err}");
        assert!(out.is_empty());
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.contains("--model") && err.contains(needle),
            "{file}: {err}"
        );
    }
    for args in [
        vec!["params"],
        vec!["params", "--preset", "flux.2"],
        vec!["params", "--preset", "flux.1-dev", "--model", "x"],
        vec!["params", "--model", "/nonexistent/config.json"],
    ] {
        let (code, _, err) = ditmem(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains("--model") || err.contains("--preset"), "{err}");
    }
}

/// A safetensors file of zeros holding `tensors` (name, shape) in `dtype`.
fn write_safetensors(path: &Path, tensors: &[(String, Vec<u64>)], dtype: &str, size: u64) {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut offset = 0u64;
    for (name, shape) in tensors {
        let bytes = shape.iter().product::<u64>() * size;
        header.insert(
            name.clone(),
            json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    let text = serde_json::to_vec(&Value::Object(header)).unwrap();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    out.resize(out.len() + offset as usize, 0);
    std::fs::write(path, out).unwrap();
}

/// The state dict of a model as `ditmem params --tensors` lists it.
fn state_dict(model: &str) -> Vec<(String, Vec<u64>)> {
    let v = json_of(&["params", "--model", model, "--tensors"]);
    v["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["kind"] != "buffer-non-persistent")
        .map(|t| {
            let shape = t["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect();
            (t["name"].as_str().unwrap().to_string(), shape)
        })
        .collect()
}

#[test]
fn weights_headers_are_held_against_the_table() {
    let dir = temp_dir("params", "weights");
    // The small SD3 variant: a persistent-free table (its position buffer is non-persistent).
    let model = saved("sd3-tiny-dual-last");
    let model = model.to_str().unwrap();
    let sd = state_dict(model);
    let file = dir.join("model.safetensors");
    write_safetensors(&file, &sd, "BF16", 2);
    let v = json_of(&argv_with(
        "params --model {} --weights {}",
        &[model, file.to_str().unwrap()],
    ));
    assert_eq!(v["weights"]["tensors"], sd.len() as u64);
    assert_eq!(v["weights"]["dtypes"]["BF16"], sd.len() as u64);
    assert_eq!(
        v["weights"]["bytes"],
        2 * v["params"]["total"].as_u64().unwrap()
    );

    // Sharded: two files and an index.
    let (a, b) = sd.split_at(sd.len() / 2);
    write_safetensors(&dir.join("s-1.safetensors"), a, "F32", 4);
    write_safetensors(&dir.join("s-2.safetensors"), b, "F32", 4);
    let mut map = serde_json::Map::new();
    for (n, _) in a {
        map.insert(n.clone(), "s-1.safetensors".into());
    }
    for (n, _) in b {
        map.insert(n.clone(), "s-2.safetensors".into());
    }
    let index = dir.join("model.safetensors.index.json");
    std::fs::write(
        &index,
        json!({"metadata": {}, "weight_map": map}).to_string(),
    )
    .unwrap();
    let v = json_of(&argv_with(
        "params --model {} --weights {}",
        &[model, index.to_str().unwrap()],
    ));
    assert_eq!(v["weights"]["files"], 2);
    assert_eq!(v["weights"]["tensors"], sd.len() as u64);

    // A wrong shape, a missing tensor, an extra tensor, a header past the file: exit 2.
    let mut wrong = sd.clone();
    wrong[3].1[0] += 1;
    let mut short = sd.clone();
    short.pop();
    let mut extra = sd.clone();
    extra.push(("lora.weight".into(), vec![2]));
    for (case, tensors, needle) in [
        ("shape", wrong, "has shape"),
        ("missing", short, "missing"),
        ("extra", extra, "not in the model"),
    ] {
        let f = dir.join(format!("{case}.safetensors"));
        write_safetensors(&f, &tensors, "BF16", 2);
        let (code, _, err) =
            ditmem(&["params", "--model", model, "--weights", f.to_str().unwrap()]);
        assert_eq!(code, 2, "{case}: {err}");
        assert!(
            err.contains("--weights") && err.contains(needle),
            "{case}: {err}"
        );
    }
    let f = dir.join("lying.safetensors");
    let mut bytes = u64::MAX.to_le_bytes().to_vec();
    bytes.extend(b"{}");
    std::fs::write(&f, bytes).unwrap();
    exits_naming(
        &["params", "--model", model, "--weights", f.to_str().unwrap()],
        2,
        "header",
    );
    let traversal = dir.join("evil.index.json");
    std::fs::write(&traversal, r#"{"weight_map": {"a": "../../etc/passwd"}}"#).unwrap();
    let (code, _, err) = ditmem(&argv_with(
        "params --model {} --weights {}",
        &[model, traversal.to_str().unwrap()],
    ));
    assert_eq!(code, 2, "{err}");
}
