# Two commands do all set-up on a fresh machine: `make run` (the main job) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# DeepSpeed JIT-compiles a small C++ op on its first CPU run; keep the build with this environment so that other
# environments sharing the default cache do not rebuild it back and forth.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions

.PHONY: run test venv schemas bench goldens clean fuzz docs conformance conformance-record-deepspeed

$(STAMP): requirements-dev.txt requirements-nodeps.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-nodeps.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	# Horovod 0.28.1 does not build against torch 2.13: only its source is read (schemas/_generate_horovod_keys.py).
	$(PY) -m pip download --quiet --no-deps --no-binary :all: horovod==0.28.1 -d $(VENV)/sdist
	touch $(STAMP)

venv: $(STAMP)

## The main job: convert the example configs and print their reports.
run: $(STAMP)
	$(PY) -m torsh.demo

## The whole test suite, its modules spread over TEST_WORKERS processes (pytest-xdist; each module stays in one
## worker, so a module's shared multi-process run happens once). TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 3
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

## DeepSpeed's own unit tests (the archive in ../shared/conformance/, unchanged) on torsh, 2 CPU ranks, each test's
## outcome compared with torsh's column of tests/deepspeed_unit_results.tsv: fails on any change, in either direction
## (tests/conformance/README.md). UPDATE=1 rewrites that column instead (review the diff, give each new difference
## its reason); CONFORMANCE_ARGS passes options (--files unit/..., --all-files, --test-timeout S, --jobs N).
## CONFORMANCE_ARCHIVE names a larger archive to run from (tests/conformance/extend_archive.py builds one); files the
## list runs that the archive in use lacks are reported and skipped.
CONFORMANCE_ARGS ?=
CONFORMANCE_ARCHIVE ?=
conformance: $(STAMP)
	$(PY) tests/conformance/run_deepspeed.py $(if $(UPDATE),--update) \
		$(if $(CONFORMANCE_ARCHIVE),--archive $(CONFORMANCE_ARCHIVE)) $(CONFORMANCE_ARGS)

## The same tests on real DeepSpeed 0.19.8, rewriting DeepSpeed's column of the list (not run in CI: DeepSpeed
## JIT-builds its C++ ops into TORCH_EXTENSIONS_DIR first, a few minutes).
conformance-record-deepspeed: $(STAMP)
	$(PY) tests/conformance/run_deepspeed.py --engine deepspeed --update \
		$(if $(CONFORMANCE_ARCHIVE),--archive $(CONFORMANCE_ARCHIVE)) $(CONFORMANCE_ARGS)

## Regenerate the schemas generated from code.
schemas: $(STAMP)
	$(PY) -m torsh.schemas

clean:
	rm -rf $(VENV) .pytest_cache

## Benchmarks: torsh against hand-written PyTorch and DeepSpeed (ratios measured in one run), then the memory per rank
## while a model is built under deepspeed.zero.Init, against DeepSpeed's.
bench: $(STAMP)
	$(PY) -m benchmarks --update-readme
	$(PY) -m benchmarks.zero_init
	$(PY) -m benchmarks.nvme_offload
	$(PY) -m benchmarks.context_parallel

## Regenerate the golden files of migration_examples/ after an intended change (review the diff).
goldens: $(STAMP)
	TORSH_UPDATE_GOLDENS=1 $(PY) -m pytest -q -p no:randomly -k "golden" $$(grep -l "check_golden" tests/test_*.py)

## Long fuzzing run: FUZZ_INPUTS inputs per reader and per file parser, each with a FUZZ_TIMEOUT-second limit; prints
## per reader the inputs, crashes and hangs, keeps crashing inputs in tests/fixtures/fuzz_regressions/ (exit 1 if any).
FUZZ_INPUTS ?= 100000
FUZZ_TIMEOUT ?= 10
## Then the readers against the frameworks' own parsers on DIFFERENTIAL_MUTATIONS mutated inputs per dialect (at most
## as many as the corpus files give; make test runs 120).
DIFFERENTIAL_MUTATIONS ?= 20000
fuzz: $(STAMP)
	$(PY) tests/fuzz_long.py --inputs $(FUZZ_INPUTS) --timeout $(FUZZ_TIMEOUT)
	TORSH_DIFFERENTIAL_MUTATIONS=$(DIFFERENTIAL_MUTATIONS) $(PY) -m pytest -q -n $(TEST_WORKERS) tests/test_differential_readers.py

## The documentation site (mkdocs.yml, docs/) built into site/; --strict fails on any broken link or reference.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site
