//! Human output: aligned tables with binary units, and the plain words that explain a budget.

mod estimate;
mod table;
mod text;
mod words;

pub use estimate::*;
pub use table::*;
pub use text::*;
pub use words::*;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recompute_flags_write_runs_and_read_back() {
        use ditmem_budget::Recompute;
        for v in [
            vec![0, 1, 2, 3, 5, 7, 8],
            vec![4],
            vec![0, 2, 4],
            (0..57).collect(),
        ] {
            let r = Recompute::Blocks(v);
            let text = recompute_flag(&r);
            assert_eq!(text.parse::<Recompute>().unwrap(), r, "{text}");
        }
        assert_eq!(
            recompute_flag(&Recompute::Blocks(vec![0, 1, 2, 3, 5, 7, 8])),
            "blocks:0-3,5,7,8"
        );
        assert_eq!(recompute_flag(&Recompute::All), "all");
    }

    #[test]
    fn counts_get_separators() {
        assert_eq!(fmt_count(675_129_632), "675,129,632");
        assert_eq!(fmt_count(12), "12");
    }

    #[test]
    fn table_aligns() {
        let mut t = Table::new(&["a", "bb"]);
        t.row(vec!["long name".into(), "1".into()]);
        let s = t.render();
        assert!(s.contains("long name   1"));
    }
}
