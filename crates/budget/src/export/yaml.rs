//! The little YAML the accelerate config needs, written with every string quoted.
//!
//! accelerate reads its config with PyYAML's `yaml.safe_load` (accelerate 1.15
//! `commands/config/config_args.py`, `BaseConfig.from_yaml_file`), which resolves plain scalars
//! by YAML 1.1: `no`, `off`, `yes`, `on`, `y`, `n` become booleans, `0o7`/`1_000` numbers, `~`
//! null (PyYAML `resolver.py`). A plain `mixed_precision: no` is therefore `False`, and
//! `accelerate launch` fails on `False.lower()`. Here a string is always single-quoted (a quote
//! inside doubled, as YAML requires), so it can only read back as a string; numbers and
//! booleans are written plain from typed values.

/// A YAML value of the accelerate config.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Yaml {
    Str(String),
    Int(i64),
    Bool(bool),
    Map(Vec<(&'static str, Yaml)>),
}

impl Yaml {
    pub(super) fn str(s: impl Into<String>) -> Yaml {
        Yaml::Str(s.into())
    }
}

/// A single-quoted YAML scalar.
pub(super) fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// `map` as block YAML, keys in the given order.
pub(super) fn emit(map: &[(&'static str, Yaml)]) -> String {
    let mut out = String::new();
    emit_into(map, 0, &mut out);
    out
}

fn emit_into(map: &[(&'static str, Yaml)], indent: usize, out: &mut String) {
    let pad = " ".repeat(indent);
    for (k, v) in map {
        match v {
            Yaml::Map(m) if m.is_empty() => out.push_str(&format!("{pad}{k}: {{}}\n")),
            Yaml::Map(m) => {
                out.push_str(&format!("{pad}{k}:\n"));
                emit_into(m, indent + 2, out);
            }
            Yaml::Str(s) => out.push_str(&format!("{pad}{k}: {}\n", quote(s))),
            Yaml::Int(i) => out.push_str(&format!("{pad}{k}: {i}\n")),
            Yaml::Bool(b) => out.push_str(&format!("{pad}{k}: {b}\n")),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use yaml_rust2::parser::{Event, Parser};
    use yaml_rust2::scanner::TScalarStyle;

    /// How PyYAML's `SafeLoader` resolves a plain scalar (YAML 1.1, `resolver.py`'s implicit
    /// resolvers for bool, int, float and null), for the cases a config can meet.
    fn yaml11_plain(s: &str) -> Yaml {
        const TRUE: [&str; 9] = [
            "yes", "Yes", "YES", "true", "True", "TRUE", "on", "On", "ON",
        ];
        const FALSE: [&str; 9] = [
            "no", "No", "NO", "false", "False", "FALSE", "off", "Off", "OFF",
        ];
        if TRUE.contains(&s) {
            return Yaml::Bool(true);
        }
        if FALSE.contains(&s) {
            return Yaml::Bool(false);
        }
        if let Ok(i) = s.replace('_', "").parse::<i64>() {
            return Yaml::Int(i);
        }
        // Anything else that PyYAML would not keep as a string (floats, null) is marked so that
        // it never equals an intended string.
        if s.is_empty() || s == "~" || s == "null" || s.parse::<f64>().is_ok() {
            return Yaml::Str(format!("<not a string: {s}>"));
        }
        Yaml::Str(s.to_string())
    }

    /// Parse `text` with yaml-rust2's event parser (a real YAML parser), resolving each scalar as
    /// PyYAML would: a quoted scalar is a string, a plain one goes through [`yaml11_plain`].
    pub(crate) fn read_back(text: &str) -> Vec<(String, Yaml)> {
        let mut events = Vec::new();
        let mut p = Parser::new_from_str(text);
        loop {
            let (ev, _) = p.next_token().expect("the YAML parses");
            if ev == Event::StreamEnd {
                break;
            }
            events.push(ev);
        }
        let mut it = events.into_iter();
        // StreamStart, DocumentStart, MappingStart
        for ev in it.by_ref() {
            if matches!(ev, Event::MappingStart(..)) {
                break;
            }
        }
        fn map(it: &mut dyn Iterator<Item = Event>) -> Vec<(String, Yaml)> {
            let mut out = Vec::new();
            loop {
                let key = match it.next() {
                    Some(Event::Scalar(k, _, _, _)) => k,
                    _ => return out,
                };
                let v = match it.next() {
                    Some(Event::Scalar(v, TScalarStyle::Plain, _, _)) => yaml11_plain(&v),
                    Some(Event::Scalar(v, _, _, _)) => Yaml::Str(v),
                    Some(Event::MappingStart(..)) => Yaml::Map(
                        map(it)
                            .into_iter()
                            .map(|(k, v)| (&*Box::leak(k.into_boxed_str()), v))
                            .collect(),
                    ),
                    other => panic!("unexpected {other:?}"),
                };
                out.push((key, v));
            }
        }
        map(&mut it)
    }

    #[test]
    fn strings_read_back_as_strings_even_yaml11_booleans() {
        let m = vec![
            ("mixed_precision", Yaml::str("no")),
            ("distributed_type", Yaml::str("NO")),
            ("odd", Yaml::str("it's on")),
            ("num_processes", Yaml::Int(8)),
            ("use_cpu", Yaml::Bool(false)),
            ("inner", Yaml::Map(vec![("zero_stage", Yaml::Int(3))])),
        ];
        let text = emit(&m);
        let back = read_back(&text);
        let want: Vec<(String, Yaml)> = m.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        assert_eq!(back, want, "{text}");
        // The bug this guards against: unquoted, `no` reads back as a boolean.
        assert_eq!(
            read_back("mixed_precision: no\n"),
            vec![("mixed_precision".to_string(), Yaml::Bool(false))]
        );
    }
}
