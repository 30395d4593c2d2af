# The two commands of the README: `make demo` (the main job) and `make test`.
BUILD_DIR ?= build
export BUILD_DIR
NPROC := $(shell nproc)

.PHONY: all setup build test test-gpu demo clean
all: build

setup build:
	bash scripts/setup.sh

test: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(NPROC)

# On a GPU host: only the tests labelled gpu.
test-gpu: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -L gpu

demo: build
	bash scripts/demo.sh

clean:
	rm -rf $(BUILD_DIR)
