//! The integration tests, in one binary (each test binary links libtorch, so one link instead
//! of one per file). One module per concern; `common` holds the shared helpers (tiny random
//! models, datasets, the CLI runner). Select a module with its path as the filter, e.g.
//! `cargo test --release --locked --test it ui_render::`; the GPU-only tests are ignored and
//! run with `--ignored gpu_decode::` (one CUDA device) or `--ignored nccl` (two and libnccl).

mod common;

mod attach_e2e;
mod bad_input;
mod bad_models;
mod bench;
mod control_faults;
mod data_formats;
mod demo;
mod drafter;
mod faults;
mod forward;
mod gguf_import;
mod gpu_decode;
mod honest_numbers;
mod layering;
mod loader;
mod prepare_data;
mod regenerate;
mod run_checks;
mod speculative;
mod target_families;
mod train_cli;
mod trainer;
mod tui_e2e;
mod ui_render;
mod validation;
