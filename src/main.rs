fn main() -> std::process::ExitCode {
    dflash_tui::cli::main()
}
