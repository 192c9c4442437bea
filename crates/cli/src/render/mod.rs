//! Human output: aligned tables with binary units, and the plain words that explain a budget.

mod estimate;
mod table;
mod text;
mod words;

pub(crate) use estimate::*;
pub(crate) use table::*;
pub(crate) use text::*;
pub(crate) use words::*;

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
    fn clauses_split_outside_parentheses_only() {
        assert_eq!(
            clauses("a (b; c) d; e; f (g)"),
            vec!["a (b; c) d", "e", "f (g)"]
        );
        assert_eq!(clauses("one"), vec!["one"]);
        // A ';' without its space is not a clause break.
        assert_eq!(clauses("a;b; c"), vec!["a;b", "c"]);
    }

    #[test]
    fn a_short_form_drops_long_asides_before_cutting_words() {
        let why = "nothing fits 22.5 GiB usable (23.7 GiB budget less 5 % headroom): the \
                   smallest peak is 29.3 GiB (precision bf16-mixed → bf16-pure, recompute the \
                   first 39 of 40 blocks, base stored nf4 (bitsandbytes; the adapters train in \
                   the compute dtype)), where activations dominate with 21.5 GiB (73 %); \
                   sharding (ZeRO) needs --ranks N > 1";
        let short = wrap_at_most(why, 60, 2, 3, "(more)");
        let one_line = short.split_whitespace().collect::<Vec<_>>().join(" ");
        assert_eq!(
            one_line,
            "nothing fits 22.5 GiB usable: the smallest peak is 29.3 GiB, where activations \
             dominate with 21.5 GiB (73 %); sharding (ZeRO) needs --ranks N > 1; (more)"
        );
        // Every parenthesis it opens, it closes.
        assert_eq!(short.matches('(').count(), short.matches(')').count());
        // Room for it all: nothing dropped, nothing added.
        assert_eq!(wrap_at_most(why, 400, 2, 3, "(more)"), wrap(why, 400, 2));
    }

    #[test]
    fn counts_get_separators() {
        assert_eq!(fmt_count(675_129_632), "675,129,632");
        assert_eq!(fmt_count(12), "12");
    }

    #[test]
    fn a_column_table_is_the_table_written_row_by_row() {
        let items = [("a", 1u64), ("long name", 12_345)];
        let columns: [Column<&(&str, u64)>; 2] = [
            ("name", &|x| x.0.to_string()),
            ("count", &|x| fmt_count(x.1)),
        ];
        let mut by_rows = Table::new(&["name", "count"]);
        by_rows.row(vec!["a".into(), "1".into()]);
        by_rows.row(vec!["long name".into(), "12,345".into()]);
        assert_eq!(Table::of(&columns, &items).render(), by_rows.render());
        // No items: the header alone.
        assert_eq!(
            Table::of(&columns, &[]).render(),
            Table::new(&["name", "count"]).render()
        );
    }

    #[test]
    fn relative_errors_are_signed_and_need_a_measurement() {
        assert_eq!(rel_err_pct(101, 100, 3), "+1.000 %");
        assert_eq!(rel_err_pct(99, 100, 2), "-1.00 %");
        assert_eq!(rel_err_pct(100, 100, 3), "+0.000 %");
        assert_eq!(rel_err_pct(5, 0, 3), "-");
    }

    #[test]
    fn a_breakdown_table_lists_the_categories_that_hold_bytes() {
        let b = ditmem_budget::Breakdown {
            weights: 3 << 20,
            gradients: 1 << 20,
            ..Default::default()
        };
        let text = breakdown_table("at the peak", &b, 4 << 20).render();
        assert!(text.starts_with("  at the peak"), "{text}");
        assert!(
            text.contains("weights") && text.contains("75.0 %"),
            "{text}"
        );
        assert!(
            text.contains("gradients") && text.contains("25.0 %"),
            "{text}"
        );
        assert_eq!(text.lines().count(), 4, "header, rule, two rows:\n{text}");
    }

    #[test]
    fn table_aligns() {
        let mut t = Table::new(&["a", "bb"]);
        t.row(vec!["long name".into(), "1".into()]);
        let s = t.render();
        assert!(s.contains("long name   1"));
    }
}
