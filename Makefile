# Two commands: `make train` (set up, prepare tiny Shakespeare, train a small model on the CPU) and `make test`.
# Offline machines: the corpus and GPT-2's BPE ranks are taken from $(SHARED) when present, else from
# TINYSHAKESPEARE / GPT2_VOCAB, else downloaded. A SHARED= given on the command line must hold both.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
SHARED ?= ../shared/data

ifneq ($(wildcard $(SHARED)/gpt2.tiktoken),)
export GPT2_VOCAB ?= $(abspath $(SHARED)/gpt2.tiktoken)
endif
ifneq ($(wildcard $(SHARED)/tinyshakespeare.txt),)
export TINYSHAKESPEARE ?= $(abspath $(SHARED)/tinyshakespeare.txt)
endif

# a SHARED= that the user gave (not this file's default) and that lacks a file: said, not passed over
ifneq ($(origin SHARED),file)
SHARED_MISSING := $(strip $(foreach f,tinyshakespeare.txt gpt2.tiktoken,$(if $(wildcard $(SHARED)/$(f)),,$(f))))
endif

DATA := data/tinyshakespeare/tiny_shakespeare_train.bin
TRAIN_STEPS ?= 250
RESUME ?= 0
# make train passes them to the trainer as -x and -y, whose errors would name those flags: a wrong one is
# said here (for train alone: another target does not read them, and RESUME is a common name)
ifneq ($(filter train,$(MAKECMDGOALS)),)
ifneq ($(shell echo '$(TRAIN_STEPS)' | grep -Ex '[1-9][0-9]*'),$(TRAIN_STEPS))
$(error TRAIN_STEPS=$(TRAIN_STEPS): the steps to train to, a whole number of 1 or more)
endif
ifeq ($(filter 0 1,$(RESUME)),)
$(error RESUME=$(RESUME): 1 resumes the run in log_train, 0 (the default) starts one)
endif
endif

.PHONY: setup data train test bench clean
setup: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

data: $(DATA)
$(DATA): $(VENV)/.installed
	$(if $(SHARED_MISSING),$(error SHARED=$(SHARED): $(if $(wildcard $(SHARED)/.),no $(SHARED_MISSING) \
		there,no such folder): make takes tinyshakespeare.txt and gpt2.tiktoken from it))
	$(PY) -m data.tinyshakespeare

# a 4-layer, 256-channel GPT-2 (~16M parameters, most in wte) for a few minutes on 2 cores; the model
# of the last step goes to log_train/model_00000250.bin, for python -m llm.sample. The tests run this
# recipe with fewer steps (TRAIN_STEPS=...). RESUME=1 goes on from log_train's newest checkpoint (with a
# larger TRAIN_STEPS, on to that step); without it, an earlier run's log_train stops make here.
train: data
	$(if $(filter 0,$(RESUME)),$(if $(wildcard log_train/main.log log_train/DONE_*),$(error log_train holds \
		an earlier run: rm -rf log_train to train anew, or make train RESUME=1 to resume it (with \
		TRAIN_STEPS=500: on to step 500))))
	$(PY) train_gpt2.py -e d4c256h4 -b 8 -t 64 -l 1e-3 -u 20 -x $(TRAIN_STEPS) -v 50 -m 4 \
		-s $(TRAIN_STEPS) -g 48 -n $(TRAIN_STEPS) -o log_train -y $(RESUME)

test: setup
	$(PY) -m pytest -q
	$(PY) test_gpt2.py

bench: setup
	$(PY) -m bench.step --backend numpy

clean:
	rm -rf $(VENV) *.egg-info data/tinyshakespeare gpt2_tokenizer.bin log_train
