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

.PHONY: book test pytest notebooks mutation clean

$(READY): pyproject.toml tools/setup_env.sh
	VENV=$(VENV) bash tools/setup_env.sh
	touch $@

# Executes every chapter; an execution error or any Sphinx warning fails the build.
book: $(READY)
	$(RUN) $(BIN)/jupyter-book build . --warningiserror --nitpick --keep-going

# The whole suite: the book build (every chapter executed), then unit and property tests and
# the assignment grader's tests (tests/test_grade.py grades every solution notebook).
test: book pytest

pytest: $(READY)
	$(RUN) $(BIN)/python -m pytest

# Regenerate what is derived from a single source: Colab notebooks from chapter sources (plain
# Markdown, with the glued values of the last `make book`), student notebooks from solution
# notebooks. Tests fail when these are stale.
notebooks: $(READY)
	$(BIN)/python -m pagedlab.colab book/ch*.md
	$(BIN)/python -m pagedlab.assignments notebooks/solutions notebooks/student

# Mutation testing of the allocator, the scheduler and the simulator (not part of `make test`:
# it takes an hour or more on 2 cores). Config in pyproject.toml; results in tests/MUTATION.md.
# One torch thread: mutmut forks each mutant's run from a process that has run torch, and a
# fork taken while torch's thread pool is up deadlocks (mutmut would count it a timeout).
mutation: $(READY)
	$(BIN)/python -c "import mutmut" 2>/dev/null || $(BIN)/python -m pip install -q -e ".[mutation]"
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nice -n 10 $(BIN)/mutmut run --max-children 2
	$(BIN)/mutmut results

clean:
	rm -rf _build mutants
