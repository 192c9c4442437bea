//! The plots a person reads (`estimate --plot`, `compare --plot`, `plan --plot`): every text's
//! box, estimated from its font size, anchor and length, stays inside the viewBox and overlaps
//! no other text, and the SVG fits a laptop screen. The estimate is this file's own (not the
//! renderer's), at 0.6 em per character as for a sans-serif font.

mod common;

use common::{argv, ditmem, temp_dir};

/// Average advance per character, in em, of the check (the renderer reserves more).
const GLYPH_EM: f64 = 0.6;
const ASCENT_EM: f64 = 0.8;
const DESCENT_EM: f64 = 0.25;

#[derive(Debug, Clone)]
struct TextBox {
    text: String,
    x0: f64,
    y0: f64,
    x1: f64,
    y1: f64,
}

fn attr(tag: &str, name: &str) -> Option<String> {
    let key = format!(" {name}=\"");
    let i = tag.find(&key)? + key.len();
    let j = tag[i..].find('"')? + i;
    Some(tag[i..j].to_string())
}

fn unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&#39;", "'")
        .replace("&amp;", "&")
}

/// The viewBox (width, height) and every text's estimated box; a text this check cannot size
/// (rotated, shifted by `dy`, no font size) is an error.
fn text_boxes(svg: &str) -> Result<((f64, f64), Vec<TextBox>), String> {
    let root_end = svg.find('>').ok_or("no root element")?;
    let root = &svg[..root_end];
    let vb = attr(root, "viewBox").ok_or("the root has no viewBox")?;
    let v: Vec<f64> = vb
        .split_whitespace()
        .map(|x| x.parse().map_err(|e| format!("viewBox {vb}: {e}")))
        .collect::<Result<_, _>>()?;
    if v.len() != 4 || v[0] != 0.0 || v[1] != 0.0 {
        return Err(format!("viewBox {vb}: expected 0 0 W H"));
    }
    let mut out = Vec::new();
    // Offsets of the nested <svg x= y=> elements around the current point (the old side-by-side
    // timeline nested two charts).
    let mut offsets: Vec<(f64, f64)> = Vec::new();
    let mut pos = root_end;
    loop {
        let next = ["<svg", "</svg>", "<text"]
            .iter()
            .filter_map(|k| svg[pos..].find(k).map(|i| (pos + i, *k)))
            .min();
        let Some((i, kind)) = next else { break };
        let after = &svg[i..];
        match kind {
            "<svg" => {
                let tag = &after[..after.find('>').ok_or("unclosed <svg")?];
                let f = |n| {
                    attr(tag, n)
                        .and_then(|x| x.parse::<f64>().ok())
                        .unwrap_or(0.0)
                };
                offsets.push((f("x"), f("y")));
                pos = i + 4;
                continue;
            }
            "</svg>" => {
                offsets.pop();
                pos = i + 6;
                continue;
            }
            _ => {}
        }
        let open_end = after.find('>').ok_or("unclosed <text")?;
        let tag = &after[..open_end];
        let close = after.find("</text>").ok_or("no </text>")?;
        let inner = &after[open_end + 1..close];
        if inner.contains('<') {
            return Err(format!("nested markup in a text: {inner}"));
        }
        let text = unescape(inner).trim().to_string();
        let num = |n: &str| -> Result<f64, String> {
            attr(tag, n)
                .ok_or(format!("text {text:?} has no {n}"))?
                .trim_end_matches("px")
                .parse::<f64>()
                .map_err(|e| format!("text {text:?}: {n}: {e}"))
        };
        let (mut x, mut y, size) = (num("x")?, num("y")?, num("font-size")?);
        // A baseline shift in em or ex (ex: half an em).
        if let Some(dy) = attr(tag, "dy") {
            let (v, unit) = dy.split_at(dy.len().saturating_sub(2));
            let v: f64 = v.parse().map_err(|_| format!("text {text:?}: dy {dy}"))?;
            y += match unit {
                "em" => v * size,
                "ex" => v * size / 2.0,
                _ => return Err(format!("text {text:?}: dy {dy}")),
            };
        }
        if attr(tag, "dx").is_some() {
            return Err(format!("text {text:?} has dx: its box cannot be estimated"));
        }
        let (ox, oy) = offsets
            .iter()
            .fold((0.0, 0.0), |a, o| (a.0 + o.0, a.1 + o.1));
        x += ox;
        y += oy;
        let w = text.chars().count() as f64 * size * GLYPH_EM;
        let x0 = match attr(tag, "text-anchor").as_deref() {
            None | Some("start") => x,
            Some("middle") => x - w / 2.0,
            Some("end") => x - w,
            Some(a) => return Err(format!("text {text:?}: text-anchor {a}")),
        };
        let mut b = TextBox {
            text,
            x0,
            y0: y - ASCENT_EM * size,
            x1: x0 + w,
            y1: y + DESCENT_EM * size,
        };
        if let Some(t) = attr(tag, "transform") {
            // Only a quarter turn about the text's own point is understood.
            let nums: Vec<f64> = t
                .trim_start_matches("rotate(")
                .trim_end_matches(')')
                .split([',', ' '])
                .filter(|s| !s.is_empty())
                .filter_map(|s| s.parse().ok())
                .collect();
            let quarter = nums.len() == 3 && nums[0].rem_euclid(180.0) == 90.0;
            if !t.starts_with("rotate(") || !quarter {
                return Err(format!("text {:?}: transform {t}", b.text));
            }
            let (cx, cy) = (nums[1] + ox, nums[2] + oy);
            let (dx0, dx1, dy0, dy1) = (b.x0 - cx, b.x1 - cx, b.y0 - cy, b.y1 - cy);
            // rotate(θ): x' = dx·cos θ − dy·sin θ, y' = dx·sin θ + dy·cos θ, cos θ = 0.
            let sin = nums[0].to_radians().sin().round();
            let (xa, xb) = (-sin * dy0, -sin * dy1);
            let (ya, yb) = (sin * dx0, sin * dx1);
            b = TextBox {
                x0: cx + xa.min(xb),
                x1: cx + xa.max(xb),
                y0: cy + ya.min(yb),
                y1: cy + ya.max(yb),
                ..b
            };
        }
        out.push(b);
        pos = i + close + 7;
    }
    Ok(((v[2], v[3]), out))
}

/// Every problem of an SVG: texts that leave the viewBox, pairs that overlap, a size wider
/// than 1000 px, no texts at all.
fn problems(svg: &str) -> Vec<String> {
    let ((w, h), boxes) = match text_boxes(svg) {
        Ok(x) => x,
        Err(e) => return vec![e],
    };
    let mut p = Vec::new();
    let root = &svg[..svg.find('>').unwrap_or(0)];
    match attr(root, "width").and_then(|x| x.parse::<f64>().ok()) {
        Some(width) if width <= 1000.0 => {}
        other => p.push(format!(
            "width attribute {other:?}: over 1000 px or missing"
        )),
    }
    if boxes.is_empty() {
        p.push("no text at all".into());
    }
    for b in &boxes {
        if b.x0 < 0.0 || b.y0 < 0.0 || b.x1 > w || b.y1 > h {
            p.push(format!(
                "{:?} leaves the {w}×{h} frame: ({:.0},{:.0})–({:.0},{:.0})",
                b.text, b.x0, b.y0, b.x1, b.y1
            ));
        }
    }
    for (i, a) in boxes.iter().enumerate() {
        for b in &boxes[i + 1..] {
            if a.x0 < b.x1 && b.x0 < a.x1 && a.y0 < b.y1 && b.y0 < a.y1 {
                p.push(format!("{:?} overlaps {:?}", a.text, b.text));
            }
        }
    }
    p
}

fn texts(svg: &str) -> Vec<String> {
    text_boxes(svg)
        .unwrap()
        .1
        .into_iter()
        .map(|b| b.text)
        .collect()
}

/// Run `ditmem ARGS --plot FILE` and return the SVG, checked.
fn plot(test: &str, args: &[&str]) -> String {
    let d = temp_dir("plot", test);
    let f = d.join("plot.svg");
    let mut a: Vec<&str> = args.to_vec();
    a.extend(["--plot", f.to_str().unwrap()]);
    let (code, _, err) = ditmem(&a);
    assert!(code == 0 || code == 3, "{a:?}: exit {code}: {err}");
    let svg = std::fs::read_to_string(&f).expect("the plot is written");
    let _ = std::fs::remove_dir_all(&d);
    let p = problems(&svg);
    assert!(p.is_empty(), "{args:?}:\n{}", p.join("\n"));
    svg
}

#[test]
fn the_check_catches_overlap_and_text_out_of_frame() {
    let ok = r#"<svg width="200" height="100" viewBox="0 0 200 100"><text x="10" y="20" font-size="12">peak 1 GiB</text><text x="10" y="40" font-size="12">forward</text></svg>"#;
    assert!(problems(ok).is_empty(), "{:?}", problems(ok));
    // The old timeline's failure: the peak label over a phase label.
    let overlap = r#"<svg width="200" height="100" viewBox="0 0 200 100"><text x="10" y="20" font-size="12">peak 1 GiB (block 3)</text><text x="40" y="24" font-size="12" text-anchor="start">backward</text></svg>"#;
    let p = problems(overlap);
    assert!(p.iter().any(|x| x.contains("overlaps")), "{p:?}");
    // A label cut at the right edge, as compare's peak label was.
    let cut = r#"<svg width="200" height="100" viewBox="0 0 200 100"><text x="150" y="50" font-size="13">peak 126 MiB at embed (inside)</text></svg>"#;
    let p = problems(cut);
    assert!(p.iter().any(|x| x.contains("leaves")), "{p:?}");
    // Middle and end anchors move the box.
    let end = r#"<svg width="200" height="100" viewBox="0 0 200 100"><text x="5" y="50" font-size="12" text-anchor="end">usable</text></svg>"#;
    assert!(problems(end).iter().any(|x| x.contains("leaves")));
    let wide = r#"<svg width="1420" height="480" viewBox="0 0 1420 480"><text x="5" y="50" font-size="12">a</text></svg>"#;
    assert!(problems(wide).iter().any(|x| x.contains("1000 px")));
    // Text the check cannot size is refused, not passed.
    let skewed = r#"<svg width="200" height="100" viewBox="0 0 200 100"><text x="5" y="50" font-size="12" transform="skewX(30)">MiB</text></svg>"#;
    assert!(!problems(skewed).is_empty());
    // A nested chart's texts are where its offset puts them.
    let nested = r#"<svg width="300" height="100" viewBox="0 0 300 100"><svg x="150" y="0" width="150" height="100"><text x="100" y="50" font-size="12">activations 30 %</text></svg></svg>"#;
    assert!(problems(nested).iter().any(|x| x.contains("leaves")));
}

#[test]
fn the_check_fails_on_the_plots_before_placement() {
    // `estimate --preset flux.1-dev --gpu rtx-4090 --plot` and `plan --preset dit-xl-2 --gpu
    // rtx-4090 --plot` as plotters drew them before labels were placed (kept as test data).
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/plots");
    let est = std::fs::read_to_string(format!("{dir}/before-estimate-flux.svg")).unwrap();
    let p = problems(&est);
    assert!(p.iter().any(|x| x.contains("1000 px")), "{p:?}");
    assert!(
        p.iter()
            .any(|x| x.contains("\"backward\" overlaps \"peak 368 GiB")),
        "{p:?}"
    );
    let plan = std::fs::read_to_string(format!("{dir}/before-plan.svg")).unwrap();
    let p = problems(&plan);
    assert!(
        p.iter()
            .any(|x| x.contains("DiT-XL/2: peak vs") && x.contains("leaves")),
        "{p:?}"
    );
}

#[test]
fn estimate_timeline_of_a_dit_preset() {
    let svg = plot("dit", &["estimate", "--preset", "dit-xl-2"]);
    let t = texts(&svg);
    assert!(t.iter().any(|x| x.starts_with("peak ")), "{t:?}");
    assert!(
        t.iter()
            .any(|x| x.starts_with("predicted time into the step")),
        "{t:?}"
    );
    for phase in ["forward", "backward"] {
        assert!(t.iter().any(|x| x == phase), "no {phase} in {t:?}");
    }
    assert!(svg.contains("viewBox=\"0 0 960 540\""));
}

#[test]
fn estimate_timeline_of_flux_on_a_gpu_draws_capacity_and_usable() {
    let svg = plot(
        "flux",
        &["estimate", "--preset", "flux.1-dev", "--gpu", "rtx-4090"],
    );
    let t = texts(&svg);
    assert!(
        t.iter()
            .any(|x| x.contains("capacity") && x.contains("rtx-4090")),
        "{t:?}"
    );
    assert!(t.iter().any(|x| x.contains("usable ")), "{t:?}");
    assert!(t.iter().any(|x| x.contains("rtx-4090 roofline")), "{t:?}");
}

#[test]
fn estimate_timelines_with_many_phases_and_a_card_far_above() {
    // Accumulation 8: sixteen phase spans, most too narrow for their name.
    plot(
        "acc",
        &argv("estimate --preset dit-b-2 --batch 64 --accumulation 8 --gpu a100-40gb"),
    );
    // A small step on a big card: the lines far above the curve, labels still apart.
    plot(
        "small",
        &argv("estimate --preset dit-s-2 --batch 2 --gpu h100-80gb"),
    );
    // The engine's runtime (CPU times, MiB).
    plot(
        "cpu",
        &argv("estimate --preset dit-s-2 --resolution 64 --batch 2 --runtime ditmem-cpu"),
    );
}

#[test]
fn plan_pareto_names_its_points() {
    let svg = plot(
        "plan",
        &["plan", "--preset", "dit-xl-2", "--gpu", "rtx-4090"],
    );
    let t = texts(&svg);
    for want in ["plan", "base"] {
        assert!(t.iter().any(|x| x == want), "no {want} in {t:?}");
    }
    assert!(t.iter().any(|x| x.starts_with("usable ")), "{t:?}");
    assert!(t.iter().any(|x| x.starts_with("budget ")), "{t:?}");
    assert!(
        t.iter()
            .filter(|x| x.contains("recompute") || x.contains("mb "))
            .count()
            >= 3,
        "points carry their recipe: {t:?}"
    );
}

#[test]
fn plan_pareto_when_nothing_fits() {
    plot(
        "floor",
        &argv("plan --preset dit-s-2 --resolution 128 --batch 2 --budget 64MiB"),
    );
}

#[test]
fn compare_timeline_with_its_measurement() {
    let svg = plot(
        "compare",
        &argv(
            "compare --preset dit-s-2 --resolution 64 --batch 4 --accumulation 2 --precision fp32",
        ),
    );
    let t = texts(&svg);
    assert!(t.iter().any(|x| x.starts_with("measured")), "{t:?}");
    assert!(t.iter().any(|x| x.starts_with("peak ")), "{t:?}");
}

/// Check SVGs named in `DITMEM_PLOT_CHECK` (colon-separated): how this check was shown to fail
/// on the plots before they were placed.
#[test]
#[ignore]
fn check_files_from_the_environment() {
    let files = std::env::var("DITMEM_PLOT_CHECK").unwrap_or_default();
    let mut bad = Vec::new();
    for f in files.split(':').filter(|f| !f.is_empty()) {
        let svg = std::fs::read_to_string(f).unwrap();
        for p in problems(&svg) {
            bad.push(format!("{f}: {p}"));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
