# The README's two commands: `make book` and `make test`. Both create .venv on first use.
VENV ?= .venv
BIN := $(VENV)/bin
READY := $(VENV)/.ready
# LOAD=N runs the build and the tests beside N busy processes (tools/under_load.sh), to check
# that nothing they conclude depends on an idle machine.
LOAD ?= 0
RUN := bash tools/under_load.sh $(LOAD)
# One torch (OpenMP) thread per process. Two threads on two cores shared with other programs
# spin while they wait for each other, and a step can take ten times as long.
export OMP_NUM_THREADS ?= 1

.PHONY: book pdf test unit pytest colab no-triton notebooks mutation seeds clean

$(READY): pyproject.toml course/pyproject.toml tools/setup_env.sh
	VENV=$(VENV) bash tools/setup_env.sh
	touch $@

# Executes every chapter; an execution error or any Sphinx warning fails the build.
book: $(READY)
	$(RUN) $(BIN)/jupyter-book build . --warningiserror --nitpick --keep-going

# The book as one PDF, _build/html/pagedlab.pdf, printed from the HTML build `make book` made
# (tools/book_pdf.py: every page in headless Chromium, no chapter run again); about a minute.
pdf: $(READY)
	$(RUN) $(BIN)/python tools/book_pdf.py

# The whole suite: the book build (every chapter executed) side by side with the unit and
# property tests, the assignment grader's tests (tests/test_grade.py grades every solution
# notebook) and nbval on the solution notebooks, which read nothing the build writes; then the
# book's PDF, and the browser and PDF tests of the built book.
# Side by side, the two take about as long as the book alone, idle machine or busy.
test: $(READY)
	$(RUN) $(MAKE) --no-print-directory --output-sync=target -j2 LOAD=0 book unit
	$(RUN) $(MAKE) --no-print-directory LOAD=0 pdf
	$(RUN) $(BIN)/python -m pytest tests/test_browser.py tests/test_pdf.py

# The solution notebooks, executed by nbval: every cell's stored output must reproduce
# (addresses and timings sanitized), so an edit that changes what students see is caught here.
NBVAL := -m pytest --nbval notebooks/solutions --nbval-sanitize-with notebooks/sanitize.cfg

unit: $(READY)
	$(BIN)/python -m pytest --ignore=tests/test_browser.py --ignore=tests/test_pdf.py
	$(BIN)/python $(NBVAL)

# Every chapter's Colab copy run as Colab runs it: pagedlab from its wheel, in a folder away from
# the repository; each must reproduce the values its prose quotes (timings within a factor).
# About as long as the book build, so not part of `make test`; .ci/run runs it after.
colab: $(READY)
	$(RUN) $(BIN)/python -m pytest -m colab tests/test_colab.py

# What a Mac or Windows machine runs (issue 48): Triton made unimportable, the chapters that
# launch a kernel or import the engine (their Colab copies, cell by cell), then the tests that
# hold the engine without Triton to the engine with it. The rest of the suite runs with Triton.
no-triton: $(READY)
	PAGEDLAB_BLOCK_TRITON=1 $(RUN) $(BIN)/python tools/run_chapters.py --jobs 2 --timeout 900 \
		book/ch06_*.ipynb book/ch07_*.ipynb book/ch08_*.ipynb book/ch09_*.ipynb \
		book/ch11_*.ipynb book/ch12_*.ipynb
	PAGEDLAB_BLOCK_TRITON=1 $(RUN) $(BIN)/python -m pytest -q tests/test_without_triton.py \
		tests/test_engine.py

# Every test, the browser and PDF tests included (they skip where the book is not built; the
# PDF test fails where the book is built and its PDF is not: `make pdf`).
pytest: $(READY)
	$(RUN) $(BIN)/python -m pytest
	$(RUN) $(BIN)/python $(NBVAL)

# Regenerate what is derived from a single source: Colab notebooks from chapter sources (plain
# Markdown, with the glued values of the last `make book`), student notebooks from solution
# notebooks. Tests fail when these are stale.
notebooks: $(READY)
	$(BIN)/python -m pagedlab_course.colab book/ch*.md
	$(BIN)/python -m pagedlab_course.assignments notebooks/solutions notebooks/student

# Mutation testing of the allocator, the scheduler and the simulator (not part of `make test`:
# it takes an hour or more on 2 cores). Config in pyproject.toml; results in tests/MUTATION.md.
# One torch thread: mutmut forks each mutant's run from a process that has run torch, and a
# fork taken while torch's thread pool is up deadlocks (mutmut would count it a timeout).
mutation: $(READY)
	$(BIN)/python -c "import mutmut" 2>/dev/null || $(BIN)/python -m pip install -q -e ".[mutation]"
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nice -n 10 $(BIN)/mutmut run --max-children 2
	$(BIN)/mutmut results

# Every randomized test (`pytest -m randomized`: Hypothesis tests, and tests that pick their own
# seeds) under seeds 0 to 29, one pytest run per seed (tools/seeds.py). Not part of `make test`:
# 21 minutes on 2 cores shared with other work (2026-12-05). Results in tests/MUTATION.md.
seeds: $(READY)
	nice -n 10 $(BIN)/python tools/seeds.py --seeds 0:30

clean:
	rm -rf _build mutants
