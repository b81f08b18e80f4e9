//! What reading a configuration needs besides serde: the `--set section.field=value`
//! overrides (checked against the schema of the defaults), and error messages that name the
//! field and where it came from (the override, or the file's line and column).

use anyhow::{anyhow, bail, Result};

use super::TrainConfig;

/// The default configuration as a TOML table: the sections and fields that exist, and the
/// kind of value each field takes.
pub(super) fn schema() -> Result<toml::Table> {
    match toml::Value::try_from(TrainConfig::default()) {
        Ok(toml::Value::Table(table)) => Ok(table),
        Ok(_) => bail!("config: internal error: the default configuration is not a table"),
        Err(e) => bail!("config: internal error: cannot represent the defaults: {e}"),
    }
}

/// A message for a value of the wrong type or an unknown field, naming the field and where it
/// came from: the override that set it, or the file with the position.
pub(super) fn deserialize_error(
    e: &toml::de::Error,
    text: &str,
    source: &str,
    applied: &[(String, &str)],
) -> anyhow::Error {
    let key = error_key(e);
    let message = e.message().trim();
    let field = key
        .as_ref()
        .map(|key| format!(" (in `{key}`)"))
        .unwrap_or_default();
    if let Some((_, spec)) = applied
        .iter()
        .rev()
        .find(|(k, _)| key.as_deref() == Some(k.as_str()))
    {
        return anyhow!("config: override `{spec}`: {message}{field}");
    }
    let at = locate(text, key.as_deref(), message)
        .map(|offset| format!(" ({})", position(text, offset)))
        .unwrap_or_default();
    anyhow!("config: {source}{at}: {message}{field}")
}

/// Applies one `section.field=value` override to the parsed file; returns its dotted key.
pub(super) fn apply_override(
    table: &mut toml::Table,
    schema: &toml::Table,
    spec: &str,
) -> Result<String> {
    let Some((key, raw)) = spec.split_once('=') else {
        bail!("config: override `{spec}` is not key=value (for example train.lr=1e-4)");
    };
    let (key, raw) = (key.trim(), raw.trim());
    let sections = || {
        schema
            .keys()
            .map(String::as_str)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let Some((section, field)) = key.split_once('.') else {
        bail!(
            "config: override key `{key}` is not section.field (sections: {})",
            sections()
        );
    };
    let Some(fields) = schema.get(section).and_then(toml::Value::as_table) else {
        bail!(
            "config: override key `{key}`: there is no section [{section}] (sections: {})",
            sections()
        );
    };
    let Some(default) = fields.get(field) else {
        bail!(
            "config: override key `{key}`: section [{section}] has no field `{field}` (fields: {})",
            fields
                .keys()
                .map(String::as_str)
                .collect::<Vec<_>>()
                .join(", ")
        );
    };
    let value = override_value(raw, default);
    let entry = table
        .entry(section)
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    let Some(section_table) = entry.as_table_mut() else {
        bail!(
            "config: override key `{key}`: `{section}` in the file is a {}, not a section",
            entry.type_str()
        );
    };
    section_table.insert(field.to_string(), value);
    Ok(format!("{section}.{field}"))
}

/// Reads an override value for a field whose default is `default` (which gives its kind).
fn override_value(raw: &str, default: &toml::Value) -> toml::Value {
    let parsed = parse_value(raw);
    match (default, parsed) {
        (toml::Value::String(_), Some(v @ toml::Value::String(_))) => v,
        (toml::Value::String(_), _) => toml::Value::String(raw.to_string()),
        (toml::Value::Array(_), Some(v @ toml::Value::Array(_))) => v,
        (toml::Value::Array(_), _) if raw.is_empty() => toml::Value::Array(Vec::new()),
        (toml::Value::Array(_), _) => toml::Value::Array(
            raw.split(',')
                .map(|item| {
                    let item = item.trim();
                    parse_value(item).unwrap_or_else(|| toml::Value::String(item.to_string()))
                })
                .collect(),
        ),
        (_, Some(v)) => v,
        (_, None) => toml::Value::String(raw.to_string()),
    }
}

/// `raw` as one TOML value, or `None` when it is not exactly one valid value.
fn parse_value(raw: &str) -> Option<toml::Value> {
    let mut table: toml::Table = toml::from_str(&format!("v = {raw}")).ok()?;
    if table.len() != 1 {
        return None;
    }
    table.remove("v")
}

/// The dotted key a deserialisation error is about, as toml's message gives it (`in `a.b``).
fn error_key(e: &toml::de::Error) -> Option<String> {
    e.to_string().lines().rev().find_map(|l| {
        l.trim()
            .strip_prefix("in `")?
            .strip_suffix('`')
            .map(String::from)
    })
}

/// Byte offset in `text` of what a deserialisation error is about: the value at `key`, or for
/// an unknown field (named in `message`) that field's key inside the table at `key`.
fn locate(text: &str, key: Option<&str>, message: &str) -> Option<usize> {
    let document = toml::de::DeTable::parse(text).ok()?;
    let root = toml::Spanned::new(
        document.span(),
        toml::de::DeValue::Table(document.into_inner()),
    );
    let mut node = &root;
    for part in key.into_iter().flat_map(|k| k.split('.')) {
        node = child(node.get_ref(), part)?.1;
    }
    match message.strip_prefix("unknown field `") {
        Some(rest) => {
            let name = rest.split('`').next()?;
            child(node.get_ref(), name).map(|(key_start, _)| key_start)
        }
        None => Some(node.span().start),
    }
}

type DeNode<'i> = toml::Spanned<toml::de::DeValue<'i>>;

/// Entry `name` of a table with the offset of its key, or element `name` of an array with its
/// own offset.
fn child<'a, 'i>(value: &'a toml::de::DeValue<'i>, name: &str) -> Option<(usize, &'a DeNode<'i>)> {
    match value {
        toml::de::DeValue::Table(table) => table
            .iter()
            .find(|(k, _)| k.get_ref().as_ref() == name)
            .map(|(k, v)| (k.span().start, v)),
        toml::de::DeValue::Array(items) => {
            let item = items.get(name.parse::<usize>().ok()?)?;
            Some((item.span().start, item))
        }
        _ => None,
    }
}

/// "line L, column C" (1-based) of byte offset `at` in `text`.
pub(super) fn position(text: &str, at: usize) -> String {
    let mut at = at.min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    let before = &text[..at];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    format!("line {line}, column {column}")
}
