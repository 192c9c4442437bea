//! SVG charts (plotters, SVG backend): line charts with phase markers and annotations, and
//! horizontal bars. Every command that draws (`compare`, `verify`, `plan`) goes through here.

mod canvas;
mod line;
mod pareto;
mod timeline;

pub(crate) use canvas::*;
pub(crate) use line::*;
pub(crate) use pareto::*;
pub(crate) use timeline::*;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_chart_has_series_and_labels() {
        let chart = LineChart {
            title: "live bytes".into(),
            x_desc: "event".into(),
            y_desc: "MiB".into(),
            series: vec![Series {
                name: "predicted".into(),
                points: vec![(0.0, 1.0), (1.0, 3.0), (2.0, 2.0)],
                markers: false,
                line: true,
            }],
            markers: vec![Marker {
                x: 1.0,
                label: "backward".into(),
            }],
            notes: vec![Note {
                x: 1.0,
                y: 3.0,
                label: "peak".into(),
            }],
            log_y: false,
        };
        let svg = line_chart(&chart, (600, 400)).unwrap();
        assert!(svg.starts_with("<svg"));
        assert!(svg.contains("predicted"));
        assert!(svg.contains("backward"));
        assert!(svg.contains("peak"));
    }

    #[test]
    fn log_chart_ignores_non_positive() {
        let chart = LineChart {
            series: vec![Series {
                name: "drift".into(),
                points: vec![(0.0, 0.0), (1.0, 1e-6), (2.0, 1e-4)],
                markers: true,
                line: true,
            }],
            log_y: true,
            ..LineChart::default()
        };
        assert!(line_chart(&chart, (400, 300)).unwrap().contains("drift"));
    }

    #[test]
    fn stacked_bar_names_every_segment() {
        let segs = vec![
            ("activations".to_string(), 30.0),
            ("optimizer state".to_string(), 10.0),
        ];
        let svg = stacked_bar("at the peak", "MiB", &segs, (400, 400)).unwrap();
        assert!(svg.contains("activations: 30.0 (75.0 %)"));
        assert!(svg.contains("optimizer state: 10.0 (25.0 %)"));
    }

    #[test]
    fn placed_labels_never_overlap_or_leave_the_frame() {
        // Thirty labels wanting the same point: each one placed is clear of the others and of
        // the frame; those with no free candidate are left out, not drawn over.
        let mut c = Canvas::new(300.0, 200.0);
        let within = Rect::new(10.0, 10.0, 290.0, 190.0);
        let mut placed = Vec::new();
        for k in 0..30 {
            let label = format!("recompute {k}/28, mb 2×acc 4");
            if let Some(b) = c.place(
                150.0,
                100.0,
                &around(6.0, 11.0),
                &within,
                Label::new(&label, 11.0, ""),
            ) {
                placed.push(b);
            }
        }
        assert!(placed.len() >= 4, "{}", placed.len());
        assert!(placed.len() < 30, "some must be left out");
        for (i, a) in placed.iter().enumerate() {
            assert!(a.inside(&within), "{a:?}");
            for b in &placed[i + 1..] {
                assert!(!a.overlaps(b), "{a:?} {b:?}");
            }
        }
        // A label wider than the frame is never placed.
        let long = "x".repeat(60);
        assert!(c
            .place(
                150.0,
                100.0,
                &around(6.0, 11.0),
                &within,
                Label::new(&long, 11.0, "")
            )
            .is_none());
    }

    #[test]
    fn titles_wrap_and_shorten_to_fit() {
        let t = "DiT-XL/2: peak vs predicted step time (rtx-4090 (roofline: datasheet peaks × 0.6 matmul, × 0.8 bandwidth; assumed, not measured))";
        let lines = wrap(t, 16.0, 400.0, 2);
        assert_eq!(lines.len(), 2);
        for l in &lines {
            assert!(text_width(l, 16.0) <= 400.0, "{l}");
        }
        assert!(lines[1].ends_with('…'));
        assert_eq!(wrap("short", 16.0, 400.0, 2), vec!["short".to_string()]);
    }

    #[test]
    fn ticks_are_round() {
        assert_eq!(
            nice_ticks(0.0, 56.0, 7),
            vec![0.0, 10.0, 20.0, 30.0, 40.0, 50.0]
        );
        assert_eq!(fmt_tick(0.25, 0.25), "0.25");
        assert_eq!(fmt_tick(500.0, 50.0), "500");
        assert_eq!(fmt_tick(1.5, 0.5), "1.5");
        assert_eq!(spread_order(5), vec![0, 4, 2, 1, 3]);
    }
}
