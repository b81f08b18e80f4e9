//! Where a model folder keeps its chat templates, read the way `transformers` 5 reads them for a
//! tokenizer: `chat_template.jinja` (the default template) and `additional_chat_templates/*.jinja`
//! (named ones), which transformers >= 4.43 writes on save; when neither is there, the
//! `chat_template` field of `tokenizer_config.json`, a string or a list of named templates
//! (`[{"name": "default", "template": ...}, {"name": "tool_use", ...}]`); last, the `chat_template`
//! field of `chat_template.json`, the legacy file of `transformers`' processors.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};

use super::ChatTemplate;

/// The default template's file name.
const JINJA_FILE: &str = "chat_template.jinja";
/// The folder of named templates.
const NAMED_DIR: &str = "additional_chat_templates";
/// The processors' legacy template file.
const LEGACY_JSON_FILE: &str = "chat_template.json";

/// The templates `apply_chat_template` picks from: "default", and "tool_use" for a
/// conversation with tools when the model has one. Other named templates are never picked
/// without being asked for, so they are not compiled.
#[derive(Default)]
pub(crate) struct ChatTemplates {
    default: Option<ChatTemplate>,
    tool_use: Option<ChatTemplate>,
    /// Every name the model has (for messages).
    names: Vec<String>,
    /// Where the templates were read, or where they were looked for.
    origin: String,
}

/// One template's source, and where it was read (for messages).
struct Source {
    name: String,
    text: String,
    origin: String,
}

impl ChatTemplates {
    /// Reads the templates of the model folder `dir`; `config` is its `tokenizer_config.json`'s
    /// `chat_template` field (null when absent). A template that does not compile is an error
    /// naming its file.
    pub(crate) fn read(
        dir: &Path,
        config: &serde_json::Value,
        bos_token: &Option<String>,
        eos_token: &Option<String>,
    ) -> Result<Self> {
        let (sources, origin) = template_sources(dir, config)?;
        let mut out = ChatTemplates {
            names: sources.iter().map(|s| s.name.clone()).collect(),
            origin,
            ..ChatTemplates::default()
        };
        for s in sources {
            let slot = match s.name.as_str() {
                "default" => &mut out.default,
                "tool_use" => &mut out.tool_use,
                _ => continue,
            };
            let template = ChatTemplate::new(&s.text, bos_token.clone(), eos_token.clone())
                .with_context(|| s.origin.clone())?;
            *slot = Some(template);
        }
        Ok(out)
    }

    /// The template `apply_chat_template` uses: "tool_use" for a conversation with tools when
    /// there is one, else "default".
    pub(crate) fn pick(&self, with_tools: bool) -> Result<&ChatTemplate> {
        let tool_use = self.tool_use.as_ref().filter(|_| with_tools);
        if let Some(t) = tool_use.or(self.default.as_ref()) {
            return Ok(t);
        }
        if self.names.is_empty() {
            bail!("{}", self.origin);
        }
        bail!(
            "{}: the named chat templates ({}) have none named \"default\"",
            self.origin,
            self.names.join(", ")
        )
    }
}

/// The template sources of `dir` in transformers' order of precedence, and a description of
/// where they were found (or, with none, of where they were looked for).
fn template_sources(dir: &Path, config: &serde_json::Value) -> Result<(Vec<Source>, String)> {
    let files = template_files(dir)?;
    if !files.is_empty() {
        let origin = files
            .iter()
            .map(|s| s.origin.clone())
            .collect::<Vec<_>>()
            .join(", ");
        // As in transformers, these replace whatever tokenizer_config.json holds.
        return Ok((files, origin));
    }
    let config_path = dir.join("tokenizer_config.json");
    let from_config = named_sources(config, &config_path, "chat_template")?;
    if !from_config.is_empty() {
        let origin = format!("{}: field chat_template", config_path.display());
        return Ok((from_config, origin));
    }
    let legacy = dir.join(LEGACY_JSON_FILE);
    if legacy.is_file() {
        let text = read_text(&legacy)?;
        let value: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{}: not valid JSON", legacy.display()))?;
        let field = value
            .get("chat_template")
            .unwrap_or(&serde_json::Value::Null);
        let sources = named_sources(field, &legacy, "chat_template")?;
        if sources.is_empty() {
            bail!("{}: no field chat_template", legacy.display());
        }
        return Ok((
            sources,
            format!("{}: field chat_template", legacy.display()),
        ));
    }
    let looked = format!(
        "{}: no chat template (looked for {JINJA_FILE}, {NAMED_DIR}/*.jinja, the chat_template field of tokenizer_config.json and {LEGACY_JSON_FILE})",
        dir.display()
    );
    Ok((Vec::new(), looked))
}

/// `chat_template.jinja` as "default" and `additional_chat_templates/NAME.jinja` as NAME.
fn template_files(dir: &Path) -> Result<Vec<Source>> {
    let mut out = Vec::new();
    let default = dir.join(JINJA_FILE);
    if default.is_file() {
        out.push(file_source("default".into(), &default)?);
    }
    let named = dir.join(NAMED_DIR);
    if named.is_dir() {
        let entries = std::fs::read_dir(&named)
            .with_context(|| format!("{}: cannot list", named.display()))?;
        let mut paths: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "jinja") && p.is_file())
            .collect();
        paths.sort();
        for path in paths {
            let name = path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            out.push(file_source(name, &path)?);
        }
    }
    Ok(out)
}

fn file_source(name: String, path: &Path) -> Result<Source> {
    Ok(Source {
        name,
        text: read_text(path)?,
        origin: path.display().to_string(),
    })
}

fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))
}

/// A `chat_template` field: a string ("default"), a list of `{"name", "template"}`, or null.
fn named_sources(value: &serde_json::Value, file: &Path, field: &str) -> Result<Vec<Source>> {
    use serde_json::Value;
    let at = |what: &str| format!("{}: field {what}", file.display());
    match value {
        Value::Null => Ok(Vec::new()),
        Value::String(text) => Ok(vec![Source {
            name: "default".into(),
            text: text.clone(),
            origin: at(field),
        }]),
        Value::Array(list) => list
            .iter()
            .enumerate()
            .map(|(i, entry)| {
                let name = entry.get("name").and_then(|n| n.as_str());
                let text = entry.get("template").and_then(|t| t.as_str());
                match (name, text) {
                    (Some(name), Some(text)) => Ok(Source {
                        name: name.to_string(),
                        text: text.to_string(),
                        origin: at(&format!("{field}[{i}] (\"{name}\")")),
                    }),
                    _ => Err(anyhow!(
                        "{}: expected {{\"name\": ..., \"template\": ...}} with two strings",
                        at(&format!("{field}[{i}]"))
                    )),
                }
            })
            .collect(),
        other => bail!(
            "{}: must be a string or a list of named templates, found {}",
            at(field),
            super::json_kind(other)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn names_of(dir: &Path, config: serde_json::Value) -> Vec<String> {
        let (sources, _) = template_sources(dir, &config).unwrap();
        sources
            .iter()
            .map(|s| format!("{}={}", s.name, s.text))
            .collect()
    }

    #[test]
    fn jinja_files_win_over_tokenizer_config_which_wins_over_the_legacy_file() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        assert!(names_of(d, json!(null)).is_empty());
        std::fs::write(d.join(LEGACY_JSON_FILE), r#"{"chat_template": "legacy"}"#).unwrap();
        assert_eq!(names_of(d, json!(null)), ["default=legacy"]);
        assert_eq!(names_of(d, json!("config")), ["default=config"]);
        std::fs::create_dir(d.join(NAMED_DIR)).unwrap();
        std::fs::write(d.join(NAMED_DIR).join("tool_use.jinja"), "tools").unwrap();
        std::fs::write(d.join(NAMED_DIR).join("notes.txt"), "not a template").unwrap();
        // Files replace the config's templates, as in transformers: no default here.
        assert_eq!(names_of(d, json!("config")), ["tool_use=tools"]);
        std::fs::write(d.join(JINJA_FILE), "jinja").unwrap();
        assert_eq!(
            names_of(d, json!("config")),
            ["default=jinja", "tool_use=tools"]
        );
    }

    #[test]
    fn named_templates_in_tokenizer_config() {
        let dir = tempfile::tempdir().unwrap();
        let config = json!([
            {"name": "default", "template": "{{ 'plain' }}{% if tools %}{{ tools | length }}{% endif %}"},
            {"name": "rag", "template": "{% bad syntax"},
            {"name": "tool_use", "template": "{{ 'tools' }}{{ tools | length }}"},
        ]);
        let t = ChatTemplates::read(dir.path(), &config, &None, &None).unwrap();
        let render = |with_tools: bool| {
            let tools = [json!({"type": "function", "function": {"name": "f"}})];
            let tools = with_tools.then_some(&tools[..]);
            t.pick(with_tools)
                .unwrap()
                .render(&[], tools, false)
                .unwrap()
        };
        // The template named "rag" is not used, so not compiled.
        assert_eq!(render(false), "plain");
        assert_eq!(render(true), "tools1");

        // No "default": only a conversation with tools has a template.
        let config = json!([{"name": "tool_use", "template": "x"}]);
        let t = ChatTemplates::read(dir.path(), &config, &None, &None).unwrap();
        assert!(t.pick(true).is_ok());
        let err = t.pick(false).err().unwrap().to_string();
        assert!(
            err.ends_with("the named chat templates (tool_use) have none named \"default\""),
            "{err}"
        );
    }

    #[test]
    fn bad_templates_are_named_by_file_and_field() {
        let dir = tempfile::tempdir().unwrap();
        let err = |config: serde_json::Value| {
            let e = ChatTemplates::read(dir.path(), &config, &None, &None);
            format!("{:#}", e.err().unwrap())
        };
        assert!(err(json!(3)).contains(
            "tokenizer_config.json: field chat_template: must be a string or a list of named templates, found a number"
        ));
        assert!(err(json!([{"name": "default"}])).contains(
            "tokenizer_config.json: field chat_template[0]: expected {\"name\": ..., \"template\": ...} with two strings"
        ));
        let e = err(json!([{"name": "default", "template": "{% if %}"}]));
        assert!(
            e.contains("tokenizer_config.json: field chat_template[0] (\"default\"): the chat template does not compile"),
            "{e}"
        );
        std::fs::write(dir.path().join(JINJA_FILE), "{% for %}").unwrap();
        let e = err(json!("fine"));
        assert!(
            e.contains("chat_template.jinja: the chat template does not compile"),
            "{e}"
        );
        let t = ChatTemplates::read(&dir.path().join("nope"), &json!(null), &None, &None).unwrap();
        let e = t.pick(false).err().unwrap().to_string();
        assert!(
            e.contains("nope: no chat template (looked for chat_template.jinja"),
            "{e}"
        );
    }
}
