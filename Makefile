# The two commands of the README, plus helpers. Every target installs missing Debian packages first.
BUILD_DIR ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: all deps configure build server python run test docs bench clean

all: build

deps:
	./scripts/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

# Only what the server needs (the library, softkv-server and the softkv command-line client it names at
# start; not the tests, benchmarks, examples or the Python module).
server: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target softkv-server softkv-cli

# The Python package (the native module and the TCP client) into $(BUILD_DIR)/python/softkv.
python: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target softkv_python

# The main job on an embedded default: softkv-server on ./softkv-data, 127.0.0.1:7878 (Ctrl-C stops it
# after finishing in-flight requests and writing a snapshot).
run: server
	./$(BUILD_DIR)/server/softkv-server --data ./softkv-data --tune-scans

test: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS)

# The API reference from the public headers (Doxygen) into $(BUILD_DIR)/docs/html/index.html; fails on
# any warning, such as a public entity without its doc comment.
docs:
	./scripts/install-deps.sh doxygen
	mkdir -p $(BUILD_DIR)/docs
	SOFTKV_DOCS_OUT=$(BUILD_DIR)/docs doxygen docs/Doxyfile

# Benchmarks side by side with their peers; writes bench/results/RESULTS.md (minutes, not a test).
bench: deps
	./scripts/bench.sh

clean:
	rm -rf $(BUILD_DIR)
