//! The control room: a ratatui screen over the trainer (state, pure update, pure render, and
//! the terminal loop).

pub mod app;
pub mod feed;
pub mod render;
pub mod sample;
pub mod state;
pub mod update;
