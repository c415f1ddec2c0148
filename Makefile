# The two commands of the README, plus helpers. Every target installs missing Debian packages first.
BUILD_DIR ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: all deps configure build run test bench clean

all: build

deps:
	./scripts/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

# The main job on an embedded default: softkv-server on ./softkv-data, 127.0.0.1:7878 (Ctrl-C stops it
# after finishing in-flight requests and writing a snapshot).
run: build
	./$(BUILD_DIR)/server/softkv-server --data ./softkv-data

test: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS)

# Benchmarks side by side with their peers; writes bench/results/RESULTS.md (minutes, not a test).
bench: deps
	./scripts/bench.sh

clean:
	rm -rf $(BUILD_DIR)
