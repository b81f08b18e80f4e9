//! The control room's pure update: one `Action` type for what reaches the screen (keys, the
//! `:` line, the run's state, log and replies), turned into state changes and effects. Signals
//! are not among them: the run loop acts on them (`frontend::run_loop`), as for a run without
//! a screen.

use crate::config::{check_queue_depth, BadQueueDepth, MAX_QUEUE_DEPTH};
use crate::pipeline::command::Command;
use crate::telemetry::records::{Phase, Snapshot};

use super::state::{AppState, Mode, QuitChoice, Viewer, ZOOM_LEVELS};

/// A key, independent of the terminal library.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Key {
    Char(char),
    Enter,
    Esc,
    Backspace,
    Tab,
    BackTab,
    Up,
    Down,
    Left,
    Right,
    /// Ctrl-C
    Interrupt,
}

/// Everything that can happen to the control room.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Action {
    Key(Key),
    /// New telemetry.
    Telemetry(Box<Snapshot>),
    /// The reply to a command that was sent.
    Reply(Result<String, String>),
    /// New lines of the run's log.
    Log(Vec<String>),
    /// The live state is unavailable, and why (None: live again).
    Offline(Option<String>),
}

/// What the front end must do after an update.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Effect {
    /// Send a command to the trainer (its reply comes back as `Action::Reply`).
    Send(Command),
}

const PROFILE_STEPS: [f64; 5] = [0.0, 5.0, 10.0, 30.0, 60.0];

/// Applies one action. A read-only viewer sends queries only; what else it would send is
/// answered on its status line.
pub(crate) fn update(state: &mut AppState, action: Action) -> Vec<Effect> {
    let effects = apply(state, action);
    if !state.read_only() {
        return effects;
    }
    effects
        .into_iter()
        .filter(|effect| match effect {
            Effect::Send(cmd) if !cmd.is_query() => {
                state.status = Some((
                    format!("read-only viewer: {cmd} not sent (attach without --read-only)"),
                    true,
                ));
                false
            }
            _ => true,
        })
        .collect()
}

fn apply(state: &mut AppState, action: Action) -> Vec<Effect> {
    match action {
        Action::Log(lines) => {
            state.push_log(lines);
            vec![]
        }
        Action::Offline(why) => {
            state.offline = why;
            vec![]
        }
        Action::Telemetry(snapshot) => {
            let ended = snapshot.phase.is_ended();
            state.snapshot = *snapshot;
            let queues = state.snapshot.queues.len();
            if queues > 0 && state.selected_queue >= queues {
                state.selected_queue = queues - 1;
            }
            if ended && state.mode != Mode::Ended {
                state.mode = Mode::Ended;
            }
            vec![]
        }
        Action::Reply(reply) => {
            state.status = Some(match reply {
                Ok(m) => (m, false),
                Err(e) => (e, true),
            });
            vec![]
        }
        Action::Key(key) => on_key(state, key),
    }
}

fn on_key(state: &mut AppState, key: Key) -> Vec<Effect> {
    match state.mode.clone() {
        Mode::Ended => {
            state.quit = true;
            vec![]
        }
        Mode::Help | Mode::Status => {
            state.mode = Mode::Normal;
            vec![]
        }
        Mode::CommandLine(mut text) => match key {
            Key::Esc | Key::Interrupt => {
                state.mode = Mode::Normal;
                vec![]
            }
            Key::Enter => {
                state.mode = Mode::Normal;
                if text.trim().is_empty() {
                    return vec![];
                }
                match Command::parse(&text) {
                    // The screen holds the run's state already: shown at once, kept current.
                    Ok(Command::Status) => {
                        state.mode = Mode::Status;
                        vec![]
                    }
                    Ok(cmd) => vec![Effect::Send(cmd)],
                    Err(e) => {
                        state.status = Some((e, true));
                        vec![]
                    }
                }
            }
            Key::Backspace => {
                text.pop();
                state.mode = Mode::CommandLine(text);
                vec![]
            }
            Key::Char(c) => {
                text.push(c);
                state.mode = Mode::CommandLine(text);
                vec![]
            }
            _ => vec![],
        },
        Mode::QuitDialog { selected } => match key {
            Key::Left | Key::Up | Key::BackTab => {
                state.mode = Mode::QuitDialog {
                    selected: selected.previous(),
                };
                vec![]
            }
            Key::Right | Key::Down | Key::Tab => {
                state.mode = Mode::QuitDialog {
                    selected: selected.next(),
                };
                vec![]
            }
            Key::Esc | Key::Char('n') => {
                state.mode = Mode::Normal;
                vec![]
            }
            Key::Enter | Key::Char('y') => {
                state.mode = Mode::Normal;
                match selected {
                    QuitChoice::CheckpointAndStop => {
                        vec![Effect::Send(Command::Stop { checkpoint: true })]
                    }
                    QuitChoice::StopNow => vec![Effect::Send(Command::Stop { checkpoint: false })],
                    QuitChoice::Leave => {
                        state.quit = true;
                        vec![]
                    }
                    QuitChoice::Cancel => vec![],
                }
            }
            Key::Interrupt => interrupt(state),
            _ => vec![],
        },
        Mode::Normal => normal_key(state, key),
    }
}

fn normal_key(state: &mut AppState, key: Key) -> Vec<Effect> {
    let queues = state.snapshot.queues.len();
    match key {
        Key::Char('p') => {
            if state.snapshot.phase == Phase::Paused {
                vec![Effect::Send(Command::Resume)]
            } else {
                vec![Effect::Send(Command::Pause)]
            }
        }
        Key::Char('c') => vec![Effect::Send(Command::Checkpoint)],
        Key::Tab | Key::Char(']') => {
            if queues > 0 {
                state.selected_queue = (state.selected_queue + 1) % queues;
            }
            vec![]
        }
        Key::BackTab | Key::Char('[') => {
            if queues > 0 {
                state.selected_queue = (state.selected_queue + queues - 1) % queues;
            }
            vec![]
        }
        Key::Char('+') | Key::Char('=') | Key::Char('-') => {
            let Some(q) = state.snapshot.queues.get(state.selected_queue) else {
                return vec![];
            };
            let depth = if key == Key::Char('-') {
                q.capacity.saturating_sub(1)
            } else {
                q.capacity + 1
            };
            if let Err(e) = check_queue_depth(depth) {
                let why = match e {
                    BadQueueDepth::Zero => "depth must stay at least 1".to_string(),
                    BadQueueDepth::AboveLimit(_) => {
                        format!("depth is at its limit of {MAX_QUEUE_DEPTH}")
                    }
                };
                state.status = Some((format!("{}: {why}", q.name), true));
                return vec![];
            }
            vec![Effect::Send(Command::Queue {
                name: q.name,
                depth,
            })]
        }
        Key::Char('i') => {
            // Cycle the profile interval through a few useful values.
            let now = state.snapshot.profile_interval_s;
            let next = PROFILE_STEPS
                .iter()
                .copied()
                .find(|&s| s > now)
                .unwrap_or(PROFILE_STEPS[0]);
            vec![Effect::Send(Command::Profile { seconds: next })]
        }
        Key::Char('z') => {
            state.zoom = (state.zoom + 1).min(ZOOM_LEVELS.len() - 1);
            vec![]
        }
        Key::Char('x') => {
            state.zoom = state.zoom.saturating_sub(1);
            vec![]
        }
        Key::Char(':') => {
            state.mode = Mode::CommandLine(String::new());
            vec![]
        }
        Key::Char('?') => {
            state.mode = Mode::Help;
            vec![]
        }
        Key::Char('q') if state.read_only() => {
            state.quit = true;
            vec![]
        }
        Key::Char('q') => {
            state.mode = Mode::QuitDialog {
                selected: QuitChoice::CheckpointAndStop,
            };
            vec![]
        }
        Key::Interrupt => interrupt(state),
        _ => vec![],
    }
}

/// Ctrl-C: on the trainer's own screen what SIGINT does (stop with a checkpoint); an attached
/// screen is left, the run going on.
fn interrupt(state: &mut AppState) -> Vec<Effect> {
    state.mode = Mode::Normal;
    match state.viewer {
        Viewer::Trainer => vec![Effect::Send(Command::Stop { checkpoint: true })],
        Viewer::Attached { .. } => {
            state.quit = true;
            vec![]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::queue::{QueueLevel, QueueName};

    fn snapshot(phase: Phase) -> Snapshot {
        Snapshot {
            run_name: "t".into(),
            run_dir: "/tmp/r".into(),
            phase,
            step: 3,
            total_steps: 10,
            elapsed_s: 1.0,
            tokens_per_s: 0.0,
            samples_per_s: 0.0,
            queues: vec![
                QueueLevel {
                    name: QueueName::Batch,
                    len: 1,
                    capacity: 4,
                    pushed: 0,
                    popped: 0,
                },
                QueueLevel {
                    name: QueueName::Feature,
                    len: 0,
                    capacity: 1,
                    pushed: 0,
                    popped: 0,
                },
            ],
            profile_interval_s: 30.0,
            ..Snapshot::default()
        }
    }

    fn state(phase: Phase) -> AppState {
        AppState::new(snapshot(phase))
    }

    #[test]
    fn p_toggles_by_phase_and_c_checkpoints() {
        let mut s = state(Phase::Training);
        assert_eq!(
            update(&mut s, Action::Key(Key::Char('p'))),
            vec![Effect::Send(Command::Pause)]
        );
        let mut s = state(Phase::Paused);
        assert_eq!(
            update(&mut s, Action::Key(Key::Char('p'))),
            vec![Effect::Send(Command::Resume)]
        );
        assert_eq!(
            update(&mut s, Action::Key(Key::Char('c'))),
            vec![Effect::Send(Command::Checkpoint)]
        );
    }

    #[test]
    fn queue_selection_and_resizing() {
        let mut s = state(Phase::Training);
        assert_eq!(
            update(&mut s, Action::Key(Key::Char('+'))),
            vec![Effect::Send(Command::Queue {
                name: QueueName::Batch,
                depth: 5
            })]
        );
        update(&mut s, Action::Key(Key::Tab));
        assert_eq!(s.selected_queue, 1);
        // feature_q is at depth 1: '-' would reach 0 and is refused with a message
        assert_eq!(update(&mut s, Action::Key(Key::Char('-'))), vec![]);
        assert!(s
            .status
            .as_ref()
            .is_some_and(|(m, err)| *err && m.contains("feature_q")));
        update(&mut s, Action::Key(Key::Char(']')));
        assert_eq!(s.selected_queue, 0);
        update(&mut s, Action::Key(Key::BackTab));
        assert_eq!(s.selected_queue, 1);
        // '+' stops at the limit the config and `queue NAME DEPTH` share
        s.snapshot.queues[1].capacity = MAX_QUEUE_DEPTH;
        assert_eq!(update(&mut s, Action::Key(Key::Char('+'))), vec![]);
        assert!(s
            .status
            .as_ref()
            .is_some_and(|(m, err)| *err && m.contains("limit of 1024")));
    }

    #[test]
    fn command_line_sends_parsed_commands_and_reports_bad_ones() {
        let mut s = state(Phase::Training);
        update(&mut s, Action::Key(Key::Char(':')));
        for c in "queue feature_q 2".chars() {
            update(&mut s, Action::Key(Key::Char(c)));
        }
        assert_eq!(s.mode, Mode::CommandLine("queue feature_q 2".into()));
        let fx = update(&mut s, Action::Key(Key::Enter));
        assert_eq!(
            fx,
            vec![Effect::Send(Command::Queue {
                name: QueueName::Feature,
                depth: 2
            })]
        );
        assert_eq!(s.mode, Mode::Normal);
        update(&mut s, Action::Key(Key::Char(':')));
        for c in "explode!".chars() {
            update(&mut s, Action::Key(Key::Char(c)));
        }
        update(&mut s, Action::Key(Key::Backspace));
        assert_eq!(s.mode, Mode::CommandLine("explode".into()));
        assert_eq!(update(&mut s, Action::Key(Key::Enter)), vec![]);
        assert!(s
            .status
            .as_ref()
            .is_some_and(|(m, err)| *err && m.contains("unknown command")));
    }

    #[test]
    fn status_on_the_command_line_shows_the_status_until_a_key() {
        let mut s = state(Phase::Training);
        update(&mut s, Action::Key(Key::Char(':')));
        for c in "status".chars() {
            update(&mut s, Action::Key(Key::Char(c)));
        }
        assert_eq!(update(&mut s, Action::Key(Key::Enter)), vec![]);
        assert_eq!(s.mode, Mode::Status);
        // kept current: new telemetry leaves it up
        update(&mut s, Action::Telemetry(Box::new(snapshot(Phase::Paused))));
        assert_eq!(s.mode, Mode::Status);
        assert_eq!(update(&mut s, Action::Key(Key::Char('p'))), vec![]);
        assert_eq!(
            s.mode,
            Mode::Normal,
            "a key closes it and does nothing else"
        );
    }

    #[test]
    fn quit_dialog_choices() {
        for (moves, want) in [
            (0, vec![Effect::Send(Command::Stop { checkpoint: true })]),
            (1, vec![Effect::Send(Command::Stop { checkpoint: false })]),
            (2, vec![]),
            (3, vec![]),
        ] {
            let mut s = state(Phase::Training);
            update(&mut s, Action::Key(Key::Char('q')));
            for _ in 0..moves {
                update(&mut s, Action::Key(Key::Right));
            }
            assert_eq!(update(&mut s, Action::Key(Key::Enter)), want);
            assert_eq!(s.mode, Mode::Normal);
            assert_eq!(s.quit, moves == 2, "leave closes the screen only");
        }
        // the cursor wraps around both ways
        let mut s = state(Phase::Training);
        update(&mut s, Action::Key(Key::Char('q')));
        update(&mut s, Action::Key(Key::Up));
        assert_eq!(
            s.mode,
            Mode::QuitDialog {
                selected: QuitChoice::Cancel
            }
        );
        update(&mut s, Action::Key(Key::Down));
        assert_eq!(
            s.mode,
            Mode::QuitDialog {
                selected: QuitChoice::CheckpointAndStop
            }
        );
        let mut s = state(Phase::Training);
        update(&mut s, Action::Key(Key::Char('q')));
        assert_eq!(update(&mut s, Action::Key(Key::Esc)), vec![]);
        assert_eq!(s.mode, Mode::Normal);
    }

    #[test]
    fn end_of_run_waits_for_a_key_then_quits() {
        let mut s = state(Phase::Training);
        update(
            &mut s,
            Action::Telemetry(Box::new(snapshot(Phase::Finished))),
        );
        assert_eq!(s.mode, Mode::Ended);
        assert!(!s.quit);
        update(&mut s, Action::Key(Key::Char('x')));
        assert!(s.quit);
    }

    #[test]
    fn help_zoom_profile_replies_and_external_commands() {
        let mut s = state(Phase::Training);
        update(&mut s, Action::Key(Key::Char('?')));
        assert_eq!(s.mode, Mode::Help);
        update(&mut s, Action::Key(Key::Char('a')));
        assert_eq!(s.mode, Mode::Normal);
        update(&mut s, Action::Key(Key::Char('z')));
        update(&mut s, Action::Key(Key::Char('z')));
        assert_eq!(s.zoom, 2);
        update(&mut s, Action::Key(Key::Char('x')));
        assert_eq!(s.zoom, 1);
        assert_eq!(
            update(&mut s, Action::Key(Key::Char('i'))),
            vec![Effect::Send(Command::Profile { seconds: 60.0 })]
        );
        update(&mut s, Action::Reply(Err("nope".into())));
        assert_eq!(s.status, Some(("nope".into(), true)));
    }

    #[test]
    fn ctrl_c_stops_from_the_trainers_screen_and_leaves_an_attached_one() {
        let mut s = state(Phase::Training);
        assert_eq!(
            update(&mut s, Action::Key(Key::Interrupt)),
            vec![Effect::Send(Command::Stop { checkpoint: true })]
        );
        assert!(!s.quit);
        let mut s = state(Phase::Training);
        s.viewer = Viewer::Attached { read_only: false };
        assert_eq!(update(&mut s, Action::Key(Key::Interrupt)), vec![]);
        assert!(s.quit, "leaving an attached screen never stops the run");
    }

    #[test]
    fn a_read_only_viewer_sends_no_commands() {
        let mut s = state(Phase::Training);
        s.viewer = Viewer::Attached { read_only: true };
        for key in ['p', 'c', '+', 'i'] {
            assert_eq!(update(&mut s, Action::Key(Key::Char(key))), vec![], "{key}");
            assert!(s
                .status
                .as_ref()
                .is_some_and(|(m, err)| *err && m.contains("read-only")));
        }
        assert_eq!(update(&mut s, Action::Key(Key::Char('q'))), vec![]);
        assert!(s.quit, "q leaves at once");
    }

    #[test]
    fn log_lines_are_kept_up_to_the_limit() {
        let mut s = state(Phase::Training);
        update(
            &mut s,
            Action::Log((0..400).map(|i| format!("line {i}")).collect()),
        );
        assert_eq!(s.log.len(), crate::frontend::tui::state::LOG_LINES);
        assert_eq!(s.log.last().map(String::as_str), Some("line 399"));
    }

    #[test]
    fn a_profile_table_in_the_log_keeps_its_title_and_verdict_only() {
        // what the trainer logs every profile interval: "\n" + the table + its verdict
        let table = crate::telemetry::profile::ProfileStats::new()
            .report()
            .table();
        let record = format!("12:00:05 I \n{table}bottleneck: drafter (busy 97 %)");
        let mut lines: Vec<String> =
            vec!["12:00:01 I paused at step 6: the next step waits".into()];
        lines.extend(record.split('\n').map(str::to_string));
        lines.push("12:00:06 W a warning".into());
        lines.push("  its second line".into());
        assert!(lines.len() > 15, "a table of many rows: {lines:?}");
        // cut inside the table, as two polls of train.log may
        let mut s = state(Phase::Training);
        let (first, second) = lines.split_at(5);
        update(&mut s, Action::Log(first.to_vec()));
        update(&mut s, Action::Log(second.to_vec()));
        let title = table.lines().next().unwrap_or_default();
        assert_eq!(
            s.log,
            vec![
                "12:00:01 I paused at step 6: the next step waits".to_string(),
                format!("12:00:05 I {title}"),
                "bottleneck: drafter (busy 97 %)".to_string(),
                "12:00:06 W a warning".to_string(),
                "  its second line".to_string(),
            ]
        );
    }
}
