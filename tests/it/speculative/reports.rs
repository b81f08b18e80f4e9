//! What reads eval's reports: `dflash-tui acceptance` replaying a report's picks, and
//! `tools/eval_compare.py` pairing two reports by prompt.

use super::*;

use tch::{Device, Kind};

#[test]
fn acceptance_reads_an_eval_report_and_reproduces_its_picks_in_f32() {
    let (tmp, _target, drafter, _head) = tiny_models(4);
    let target_dir = tmp.path().join("t");
    let prompts = tmp.path().join("prompts.jsonl");
    std::fs::write(&prompts, THREE_PROMPTS).unwrap();
    let (report, eval) = eval_report(tmp.path(), &drafter, "eval", &prompts, 20);
    let acceptance = |report: &std::path::Path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_dflash-tui"))
            .args(["acceptance", "--device", "cpu", "--json", "--target"])
            .arg(&target_dir)
            .arg(report)
            .env("DFLASH_LOG", "warn")
            .output()
            .unwrap()
    };
    let v = json_of_success(&acceptance(&report));
    let ps = eval["prompts"].as_array().unwrap();
    let steps = eval["accepted_by_slot"][0].as_u64().unwrap();
    let tokens: u64 = ps
        .iter()
        .map(|p| p["output_ids"].as_array().unwrap().len() as u64 - 1)
        .sum();
    assert_eq!(v["prompts"], 3);
    assert_eq!(v["steps"].as_u64(), Some(steps));
    assert_eq!(v["tokens"].as_u64(), Some(tokens));
    // f32, the same target: the teacher-forced forward ranks every decoded token first (an
    // off-by-one position would agree on almost none)
    assert_eq!(v["target_agrees"].as_u64(), Some(tokens), "{v}");
    let ranges = v["ranges"].as_array().unwrap();
    let sum = |field: &str| -> u64 { ranges.iter().map(|r| r[field].as_u64().unwrap()).sum() };
    assert_eq!(sum("tokens"), tokens);
    // every step drafts a first token inside the output, and each accepted draft is one the
    // report counted (fewer only where an answer was cut inside a step)
    assert_eq!(sum("first_drafted"), steps);
    let accepted_in_report: u64 = (1..4)
        .map(|k| eval["accepted_by_slot"][k].as_u64().unwrap())
        .sum();
    assert!(sum("accepted") <= accepted_in_report, "{v} {eval}");
    // a step ends at its first rejected draft
    assert!(sum("drafted") - sum("accepted") <= steps, "{v}");
    // the table, without --json
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dflash-tui"))
        .args(["acceptance", "--device", "cpu", "--target"])
        .arg(&target_dir)
        .arg(&report)
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains(&format!("3 prompts, {steps} steps, {tokens} output tokens")),
        "{table}"
    );
    // a report whose accept lengths contradict its drafts is refused, naming the prompt
    let mut bad = eval.clone();
    let length = bad["prompts"][1]["accept_lengths"][0].as_u64().unwrap();
    bad["prompts"][1]["accept_lengths"][0] = (length + 1).into();
    std::fs::write(&report, bad.to_string()).unwrap();
    let out = acceptance(&report);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("prompt 1") && err.contains("step 0:") && err.contains("the report accepted"),
        "{err}"
    );
    // a file that is not an eval report is named, with what it lacks
    std::fs::write(&report, "{\"tau\": 2.0}").unwrap();
    let out = acceptance(&report);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("eval.json") && err.contains("not an `eval --json` report"),
        "{err}"
    );
}

#[test]
fn eval_compare_pairs_two_reports_by_prompt() {
    let (tmp, _target, drafter, _head) = tiny_models(4);
    let other = Drafter::init(drafter.config.clone(), Device::Cpu, Kind::Float, 11).unwrap();
    let prompts = tmp.path().join("prompts.jsonl");
    std::fs::write(&prompts, THREE_PROMPTS).unwrap();
    let report = |drafter: &Drafter, name: &str| {
        let (file, v) = eval_report(tmp.path(), drafter, name, &prompts, 16);
        (file, v["tau"].as_f64().unwrap())
    };
    let (a, tau_a) = report(&drafter, "a");
    let (b, tau_b) = report(&other, "b");
    let compare = |x: &std::path::Path, y: &std::path::Path| {
        std::process::Command::new("python3")
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tools/eval_compare.py"
            ))
            .arg(x)
            .arg(y)
            .output()
            .expect("python3 (make setup needs it too)")
    };
    let out = compare(&a, &b);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // each tau as its report has it, and their difference
    let line = format!(
        "all shared: 3 prompts, tau A {tau_a:.3}, B {tau_b:.3}, A - B {:+.3}",
        tau_a - tau_b
    );
    assert!(text.contains(&line), "{line}\n{text}");
    // f32: both decode greedy's tokens, so every output is identical and only drafting differs
    assert!(text.contains("identical outputs: 3 prompts"), "{text}");
    // a report against itself differs by nothing, with no spread
    let out = compare(&a, &a);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("A - B +0.000 (95 % paired interval +0.000 to +0.000)"),
        "{text}"
    );
    // other prompts are refused, naming the first that differs
    std::fs::write(
        &prompts,
        "{\"prompt_ids\": [5, 9, 13]}\n{\"prompt_ids\": [41, 2]}\n",
    )
    .unwrap();
    let (c, _) = report(&drafter, "c");
    let out = compare(&a, &c);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("prompt 1 differs"), "{err}");
}

/// Three prompts of token ids, for the tests that read eval's reports.
const THREE_PROMPTS: &str =
    "{\"prompt_ids\": [5, 9, 13]}\n{\"prompt_ids\": [40, 2]}\n{\"prompt_ids\": [7, 7, 3, 30]}\n";

/// `eval --json` of `drafter` (saved as `name`) over `prompts` with `max_new` tokens: the report
/// written to `name.json` beside it, and parsed.
fn eval_report(
    tmp: &std::path::Path,
    drafter: &Drafter,
    name: &str,
    prompts: &std::path::Path,
    max_new: usize,
) -> (std::path::PathBuf, serde_json::Value) {
    let dir = drafter.save(&tmp.join(name)).unwrap();
    let out = eval_command(&tmp.join("t"), &dir, prompts)
        .args(["--max-new-tokens", &max_new.to_string(), "--json"])
        .output()
        .unwrap();
    let v = json_of_success(&out);
    let file = tmp.join(format!("{name}.json"));
    std::fs::write(&file, &out.stdout).unwrap();
    (file, v)
}
