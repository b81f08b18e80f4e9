//! The layering of the crate, written down here and checked: a module may use its own layer
//! and the layers below it, never one above (an upward import ties a low module to a high one
//! and makes a loop sooner or later).

use std::path::Path;

/// Layers from the bottom up; the first folder or file name under `src/` picks the layer.
const LAYERS: &[&[&str]] = &[
    // leaves: text and file utilities, the torch runtime and its C++ shims, telemetry types
    &[
        "text",
        "fsutil",
        "paths",
        "runtime",
        "aten_ext",
        "device_event",
        "seed",
        "telemetry",
    ],
    // models and configuration
    &["model", "gguf", "config"],
    // datasets: preparation, storage, packing, regeneration
    &["data"],
    // evaluation by speculative decoding, perplexity
    &["eval"],
    // training math: loss, optimizer, checkpoints, validation
    &["train"],
    // the staged trainer (stages, queues, gradient averaging) and the commands it takes
    &["pipeline"],
    // over the pipeline: the front ends (signals, control socket, stdin, the run loop, the
    // screen) and the benchmark
    &["frontend", "bench"],
    // the command line
    &["cli"],
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|names| names.contains(&module))
}

/// The code of a file without its test module and comments (doc links may point anywhere).
fn code_of(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(cut) => &text[..cut],
        None => text,
    };
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Every `crate::NAME` a file uses, with the line it is on.
fn crate_uses(code: &str) -> Vec<(String, String)> {
    let mut uses = Vec::new();
    for line in code.lines() {
        let mut rest = line;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            uses.push((name, line.trim().to_string()));
        }
    }
    uses
}

#[test]
fn no_module_uses_a_layer_above_its_own() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut upward = Vec::new();
    let mut unplaced = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(&src).unwrap();
        let top = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        if top == "lib" || top == "main" {
            continue;
        }
        let Some(own) = layer_of(&top) else {
            unplaced.push(rel.display().to_string());
            continue;
        };
        let code = code_of(&std::fs::read_to_string(file).unwrap());
        for (name, line) in crate_uses(&code) {
            match layer_of(&name) {
                Some(used) if used > own => {
                    upward.push(format!("{}: uses {name} ({line})", rel.display()))
                }
                Some(_) => {}
                None => unplaced.push(format!("{}: crate::{name}", rel.display())),
            }
        }
    }
    assert!(
        unplaced.is_empty(),
        "modules without a layer (add them to LAYERS): {unplaced:#?}"
    );
    assert!(
        upward.is_empty(),
        "imports from a higher layer: {upward:#?}"
    );
}

#[test]
fn the_check_sees_an_upward_import() {
    let code = code_of(
        "use crate::pipeline::queue::QueueLevel;\n/// [`crate::frontend::tui::app`]\nfn f() {}\n\
         #[cfg(test)]\nmod tests {\n use crate::cli::x;\n}\n",
    );
    let uses: Vec<String> = crate_uses(&code).into_iter().map(|u| u.0).collect();
    assert_eq!(uses, vec!["pipeline"], "comments and tests are left out");
    assert!(layer_of("pipeline") > layer_of("telemetry"));
    // The front ends sit above the trainer and below the command line only.
    assert!(layer_of("frontend") > layer_of("pipeline"));
    assert!(layer_of("cli") > layer_of("frontend"));
}
