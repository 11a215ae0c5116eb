# epd - one entry point: build, run, test, gpu-test, bench, install, dist.
#
# Switches: DEBUG=1 (-O0 -g), ASAN=1 (address+undefined sanitizers), WERROR=1, V=1 (show commands),
# WITH_CUDA=0/1 (default: 1 when nvcc and NCCL headers are found), CUDA_HOME, NCCL_HOME, PREFIX, DESTDIR.
# `make nccl-info` shows the NCCL the build uses.

.DEFAULT_GOAL := all

PREFIX ?= /usr/local
DESTDIR ?=
DEBUG ?= 0
ASAN ?= 0
WERROR ?= 0
V ?= 0
CUDA_HOME ?= /usr/local/cuda
# NCCL: NCCL_HOME if given, else the first of .deps/nccl (make deps fetches it from PyPI when no NCCL
# 2.29+ is found), the CUDA toolkit, the system and Python's nvidia-nccl package that is 2.29 or later,
# else the first one there is (NCCL 2.28 still builds).
nccl_ver = $$(sed -n 's/^\#define NCCL_VERSION_CODE *\([0-9]*\).*/\1/p' $$d/include/nccl.h 2>/dev/null)
ifeq ($(origin NCCL_HOME),undefined)
NCCL_CANDIDATES := $(CURDIR)/.deps/nccl $(CUDA_HOME) /usr \
  $(shell $(or $(PYTHON),python3) -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null)
NCCL_HOME := $(shell for d in $(NCCL_CANDIDATES); do v=$(nccl_ver); \
  [ -f $$d/include/nccl_device.h ] && [ "$${v:-0}" -ge 22900 ] && { echo $$d; exit; }; done; \
  for d in $(NCCL_CANDIDATES); do [ -f $$d/include/nccl_device.h ] && { echo $$d; exit; }; done; echo $(CUDA_HOME))
endif
NVCC ?= $(CUDA_HOME)/bin/nvcc
CUDA_ARCH ?= -gencode=arch=compute_90,code=sm_90
ifeq ($(origin WITH_CUDA),undefined)
WITH_CUDA := $(shell test -x $(NVCC) && test -f $(NCCL_HOME)/include/nccl_device.h && echo 1 || echo 0)
endif
PYTHON ?= /usr/bin/python3
VERSION := 0.1.0

B := build
Q := $(if $(filter 1,$(V)),,@)
msg = $(if $(filter 1,$(V)),,@printf '  %-6s %s\n' $(1) $(2))

CC ?= cc
WARN := -Wall -Wextra -Wshadow -Wstrict-prototypes -Wmissing-prototypes -Wvla -Wno-unused-parameter
OPT := $(if $(filter 1,$(DEBUG)),-O0 -g3,-O2 -g)
ASAN_FLAGS := -fsanitize=address,undefined -fno-omit-frame-pointer
SAN := $(if $(filter 1,$(ASAN)),$(ASAN_FLAGS))
CFLAGS_ALL := -std=gnu11 $(OPT) $(WARN) $(SAN) $(if $(filter 1,$(WERROR)),-Werror) -fPIC \
  -fvisibility=hidden -pthread -MMD -MP -Iinclude/epd -Iclient -Idaemon -Ikernels -I$(B)/gen \
  -DEPD_VERSION='"$(VERSION)"' -DEPD_WITH_CUDA=$(WITH_CUDA)
PKGS := grpc libprotobuf-c libuv libsystemd inih libmicrohttpd
PKG_CFLAGS := $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
PKG_LIBS := $(shell pkg-config --libs $(PKGS) 2>/dev/null)
CUDA_CFLAGS := $(if $(filter 1,$(WITH_CUDA)),-I$(CUDA_HOME)/include -I$(NCCL_HOME)/include)
# An NCCL outside the system's library path (.deps, a wheel, NCCL_HOME) is found at run time too.
NCCL_RPATH := $(if $(filter /usr $(CUDA_HOME),$(NCCL_HOME)),,-Wl,-rpath,$(NCCL_HOME)/lib)
# The daemon opens libnccl.so.2 when the CUDA backend starts (kernels/nccl_load.cu), so it is not linked
# with it: the host backend runs where NCCL is not installed. The tests and benchmarks link it (some call
# NCCL functions of their own); the run path finds the build's NCCL either way.
CUDA_LINK_DAEMON := -L$(CUDA_HOME)/lib64 $(NCCL_RPATH) -lcudart_static -ldl -lrt -lstdc++
CUDA_LINK := -L$(NCCL_HOME)/lib -L$(NCCL_HOME)/lib64 $(CUDA_LINK_DAEMON) -lnccl
CUDA_LIBS := $(if $(filter 1,$(WITH_CUDA)),$(CUDA_LINK))
CUDA_LIBS_DAEMON := $(if $(filter 1,$(WITH_CUDA)),$(CUDA_LINK_DAEMON))
CFLAGS_ALL += $(PKG_CFLAGS) $(CUDA_CFLAGS)
LDFLAGS_ALL := $(SAN) -pthread '-Wl,-rpath,$$ORIGIN/../lib' -Wl,--disable-new-dtags $(LDFLAGS)
NVCCFLAGS := -std=c++17 $(CUDA_ARCH) -O3 -Xcompiler -fPIC,-fvisibility=hidden -Iinclude/epd -Iclient -Ikernels \
  -I$(NCCL_HOME)/include -MMD -MP -lineinfo $(NVCCDEFS)

# ---- generated protobuf code -------------------------------------------------------------------------
HEALTH_PROTO ?= /usr/share/grpc-proto/grpc/health/v1/health.proto
GEN_C := $(B)/gen/epd.pb-c.c $(B)/gen/health.pb-c.c
GEN_H := $(GEN_C:.c=.h)
$(B)/gen/epd.pb-c.c $(B)/gen/epd.pb-c.h: proto/epd.proto
	$(call msg,PROTOC,$<)
	$(Q)mkdir -p $(B)/gen && protoc-c --proto_path=proto --c_out=$(B)/gen $<
$(B)/gen/health.pb-c.c $(B)/gen/health.pb-c.h: $(HEALTH_PROTO)
	$(call msg,PROTOC,$<)
	$(Q)mkdir -p $(B)/gen && cp $< $(B)/gen/health.proto && protoc-c --proto_path=$(B)/gen --c_out=$(B)/gen $(B)/gen/health.proto

# ---- libepd's submission kernels (client/submit.cu): a fatbin embedded as a C array --------------------
SUBMIT_ARCH ?= -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90 \
  -gencode=arch=compute_90,code=compute_90
$(B)/gen/epd_submit.fatbin: client/submit.cu include/epd/epd_device.h include/epd/epd_abi.h
	$(call msg,FATBIN,$<)
	$(Q)mkdir -p $(@D) && $(NVCC) -fatbin $(SUBMIT_ARCH) -O3 -Iinclude/epd -Iclient -o $@ $<
$(B)/gen/epd_submit_fatbin.c: $(B)/gen/epd_submit.fatbin
	$(call msg,BIN2C,$<)
	$(Q){ echo '#include <stdint.h>'; $(CUDA_HOME)/bin/bin2c --const --length \
	  --name epd_submit_fatbin $< | sed "s/^const unsigned char/__attribute__((aligned(8))) const unsigned char/"; } > $@

# ---- sources -----------------------------------------------------------------------------------------
DAEMON_MAIN := daemon/control/main.c
DAEMON_SRCS := $(filter-out $(DAEMON_MAIN),$(wildcard daemon/*/*.c))
CLIENT_SRCS := $(filter-out client/epdctl.c,$(wildcard client/*.c))
KERNEL_SRCS := $(if $(filter 1,$(WITH_CUDA)),$(wildcard kernels/*.cu),)
TEST_SRCS := $(wildcard tests/*.c)
GPU_TEST_SRCS := $(wildcard tests/gpu/*.c)
BENCH_SRCS := $(wildcard bench/*.c)

obj = $(patsubst %.c,$(B)/obj/%.o,$(1))
GEN_OBJS := $(call obj,$(GEN_C:$(B)/%=%))
DAEMON_OBJS := $(call obj,$(DAEMON_SRCS))
CLIENT_OBJS := $(call obj,$(CLIENT_SRCS)) $(if $(filter 1,$(WITH_CUDA)),$(B)/obj/gen/epd_submit_fatbin.o)
KERNEL_OBJS := $(patsubst %.cu,$(B)/obj/%.o,$(KERNEL_SRCS))

ENGINE_LIB := $(B)/lib/libepdengine.a
LIBEPD := $(B)/lib/libepd.so
LIBEPD_A := $(B)/lib/libepd_static.a
EPD := $(B)/bin/epd
EPDCTL := $(B)/bin/epdctl
TESTS := $(B)/bin/epd-tests
GPU_TESTS := $(B)/bin/epd-gpu-tests
BENCH := $(B)/bin/epd-bench
WORKER := $(B)/bin/epd-worker
# Test hooks (fault injection, delays) exist only in objects built with -DEPD_TEST_HOOKS: the test binaries
# link these before the engine library, whose own copies they replace; epd-faults is the daemon with them.
EPD_FAULTS := $(B)/bin/epd-faults
HOOK_C_SRCS := daemon/host/engine_host.c daemon/net/weights.c daemon/cuda/cuda_comm.c daemon/cuda/cnet_run.c
HOOK_C_OBJS := $(patsubst %.c,$(B)/obj-hooks/%.o,$(HOOK_C_SRCS))
HOOK_CU_OBJS := $(if $(filter 1,$(WITH_CUDA)),$(B)/obj-hooks/kernels/ht.o)

.PHONY: format-files nccl-info all run test gpu-test gpu-sanitize gpu-check bench install dist clean deps format fuzz
all: $(EPD) $(EPDCTL) $(LIBEPD) $(WORKER) $(TESTS) $(GPU_TESTS) $(EPD_FAULTS) $(B)/epd.pc

$(B)/obj/gen/%.o: $(B)/gen/%.c $(GEN_H)
	$(call msg,CC,$<)
	$(Q)mkdir -p $(@D) && $(CC) $(CFLAGS_ALL) -Wno-missing-prototypes -c $< -o $@
$(B)/obj/%.o: %.c $(GEN_H)
	$(call msg,CC,$<)
	$(Q)mkdir -p $(@D) && $(CC) $(CFLAGS_ALL) -c $< -o $@
$(B)/obj/%.o: %.cu
	$(call msg,NVCC,$<)
	$(Q)mkdir -p $(@D) && $(NVCC) $(NVCCFLAGS) -c $< -o $@
$(B)/obj-hooks/%.o: %.c $(GEN_H)
	$(call msg,CC,$< '(test hooks)')
	$(Q)mkdir -p $(@D) && $(CC) $(CFLAGS_ALL) -DEPD_TEST_HOOKS -c $< -o $@
$(B)/obj-hooks/%.o: %.cu
	$(call msg,NVCC,$< '(test hooks)')
	$(Q)mkdir -p $(@D) && $(NVCC) $(NVCCFLAGS) -DEPD_TEST_HOOKS -c $< -o $@
$(call obj,$(TEST_SRCS) $(GPU_TEST_SRCS)): CFLAGS_ALL += -DEPD_TEST_HOOKS

# The daemon also speaks to other daemons as a gRPC client (cluster rendezvous): rpc_client is shared.
$(ENGINE_LIB): $(DAEMON_OBJS) $(call obj,client/rpc_client.c) $(KERNEL_OBJS) $(GEN_OBJS)
	$(call msg,AR,$@)
	$(Q)mkdir -p $(@D) && rm -f $@ && ar rcs $@ $^
$(LIBEPD_A): $(CLIENT_OBJS) $(GEN_OBJS)
	$(call msg,AR,$@)
	$(Q)mkdir -p $(@D) && rm -f $@ && ar rcs $@ $^
$(LIBEPD): $(CLIENT_OBJS) $(GEN_OBJS) client/libepd.map
	$(call msg,LD,$@)
	$(Q)mkdir -p $(@D) && $(CC) -shared -Wl,-soname,libepd.so.1 -Wl,--version-script=client/libepd.map \
	  -o $@ $(CLIENT_OBJS) $(GEN_OBJS) $(LDFLAGS_ALL) $(PKG_LIBS) -ldl '-Wl,-rpath,$$ORIGIN'
	$(Q)ln -sf libepd.so $(B)/lib/libepd.so.1
$(EPD): $(call obj,$(DAEMON_MAIN)) $(ENGINE_LIB)
	$(call msg,LD,$@)
	$(Q)mkdir -p $(@D) && $(CC) -o $@ $^ $(LDFLAGS_ALL) $(PKG_LIBS) $(CUDA_LIBS_DAEMON) -lm
$(EPDCTL): $(call obj,client/epdctl.c) $(LIBEPD_A)
	$(call msg,LD,$@)
	$(Q)mkdir -p $(@D) && $(CC) -o $@ $^ $(LDFLAGS_ALL) $(PKG_LIBS) -ldl -lm
$(EPD_FAULTS): $(call obj,$(DAEMON_MAIN)) $(HOOK_C_OBJS) $(ENGINE_LIB)
	$(call msg,LD,$@)
	$(Q)mkdir -p $(@D) && $(CC) -o $@ $^ $(LDFLAGS_ALL) $(PKG_LIBS) $(CUDA_LIBS_DAEMON) -lm
$(TESTS): $(call obj,$(TEST_SRCS)) $(HOOK_C_OBJS) $(ENGINE_LIB) $(LIBEPD_A)
	$(call msg,LD,$@)
	$(Q)mkdir -p $(@D) && $(CC) -o $@ $^ $(LDFLAGS_ALL) $(PKG_LIBS) $(CUDA_LIBS) -ldl -lm
$(GPU_TESTS): $(call obj,$(GPU_TEST_SRCS) tests/runner_lib.c) $(HOOK_C_OBJS) $(HOOK_CU_OBJS) $(ENGINE_LIB) $(LIBEPD_A)
	$(call msg,LD,$@)
	$(Q)mkdir -p $(@D) && $(CC) -o $@ $^ $(LDFLAGS_ALL) $(PKG_LIBS) $(CUDA_LIBS) -ldl -lm
$(WORKER): $(call obj,tests/tools/epd-worker.c) $(ENGINE_LIB) $(LIBEPD_A)
	$(call msg,LD,$@)
	$(Q)mkdir -p $(@D) && $(CC) -o $@ $^ $(LDFLAGS_ALL) $(PKG_LIBS) $(CUDA_LIBS_DAEMON) -ldl -lm
$(BENCH): $(call obj,$(BENCH_SRCS)) $(if $(filter 1,$(WITH_CUDA)),$(B)/obj/bench/e2e/e2e_dev.o) $(ENGINE_LIB) $(LIBEPD_A)
	$(call msg,LD,$@)
	$(Q)mkdir -p $(@D) && $(CC) -o $@ $^ $(LDFLAGS_ALL) $(PKG_LIBS) $(CUDA_LIBS) -ldl -lm
# The same LL bench on 4 GPUs of one node (bench_ll_r4.{json,md}; skips with fewer GPUs).
BENCH_R4 := $(B)/bin/epd-bench-r4
$(B)/obj/bench/bench_ll_r4.o: bench/bench_ll.c $(GEN_H)
	$(call msg,CC,$<)
	$(Q)mkdir -p $(@D) && $(CC) $(CFLAGS_ALL) -DEPD_BENCH_RANKS=4 -c $< -o $@
$(BENCH_R4): $(B)/obj/bench/bench_ll_r4.o $(if $(filter 1,$(WITH_CUDA)),$(B)/obj/bench/e2e/e2e_dev.o) $(ENGINE_LIB) $(LIBEPD_A)
	$(call msg,LD,$@)
	$(Q)mkdir -p $(@D) && $(CC) -o $@ $^ $(LDFLAGS_ALL) $(PKG_LIBS) $(CUDA_LIBS) -ldl -lm
# The expert-map switch benchmark (in-process engine; bench/map/bench_map.c).
BENCH_MAP := $(B)/bin/epd-bench-map
$(BENCH_MAP): $(call obj,bench/map/bench_map.c) $(ENGINE_LIB) $(LIBEPD_A)
	$(call msg,LD,$@)
	$(Q)mkdir -p $(@D) && $(CC) -o $@ $^ $(LDFLAGS_ALL) $(PKG_LIBS) $(CUDA_LIBS) -ldl -lm
# The end-to-end benchmark client (one process per rank; bench/e2e/run_gpu.sh): libepd + a client kernel.
BENCH_E2E := $(B)/bin/epd-bench-e2e
$(BENCH_E2E): $(call obj,bench/e2e/bench_e2e.c) $(B)/obj/bench/e2e/e2e_dev.o $(LIBEPD_A)
	$(call msg,LD,$@)
	$(Q)mkdir -p $(@D) && $(CC) -o $@ $^ $(LDFLAGS_ALL) $(PKG_LIBS) $(CUDA_LIBS) -ldl -lm
# Signal-path microbenchmark of the queue protocol (one GPU; bench/queue/doorbell.cu).
BENCH_DOORBELL := $(B)/bin/epd-bench-doorbell
$(BENCH_DOORBELL): bench/queue/doorbell.cu
	$(call msg,NVCC,$<)
	$(Q)mkdir -p $(@D) && $(NVCC) -std=c++17 $(CUDA_ARCH) -O2 -o $@ $< -L$(CUDA_HOME)/lib64/stubs -lcuda

# The HT kernel benchmark (in-process, 2 GPUs; bench/ht/bench_ht.c).
BENCH_HT := $(B)/bin/epd-bench-ht
$(BENCH_HT): $(call obj,bench/ht/bench_ht.c) $(B)/obj/bench/ht/bench_kernels.o $(ENGINE_LIB) $(LIBEPD_A)
	$(call msg,LD,$@)
	$(Q)mkdir -p $(@D) && $(CC) -o $@ $^ $(LDFLAGS_ALL) $(PKG_LIBS) $(CUDA_LIBS) -ldl -lm
$(B)/epd.pc: client/epd.pc.in
	$(Q)mkdir -p $(@D) && sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@VERSION@|$(VERSION)|g' $< > $@

# ---- entry points ------------------------------------------------------------------------------------
deps:
	$(Q)deploy/deps.sh test

nccl-info:
	@echo "NCCL_HOME=$(NCCL_HOME) version $$(d=$(NCCL_HOME); echo $(nccl_ver)) WITH_CUDA=$(WITH_CUDA)"

# make run builds what the demo runs; without a GPU the host backend alone, in a build directory of its
# own (build/host: objects built without CUDA must not mix with the CUDA build's).
RUN_GPU := $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')
RUN_B := $(if $(filter 0,$(RUN_GPU)),$(B)/host,$(B))
run:
	$(Q)deploy/deps.sh run
	$(Q)$(MAKE) --no-print-directory B=$(RUN_B) $(if $(filter 0,$(RUN_GPU)),WITH_CUDA=0) \
	  $(RUN_B)/bin/epd $(RUN_B)/bin/epdctl $(RUN_B)/bin/epd-worker
	$(Q)B=$(RUN_B) tests/run-demo.sh

test: deps
	$(Q)$(MAKE) --no-print-directory all
	$(Q)$(TESTS)

gpu-test: all
	$(Q)EPD_BUILD=$(B) EPD_SYSTEM_TESTS=tests/gpu $(GPU_TESTS)

gpu-sanitize: all
	$(Q)tests/gpu/sanitize.sh $(B)

gpu-check: all $(BENCH) $(BENCH_HT)
	$(Q)tests/gpu/check-all.sh $(B)

bench: all $(BENCH) $(BENCH_R4) $(if $(filter 1,$(WITH_CUDA)),$(BENCH_E2E))
	$(Q)bench/bench.sh

install: all
	$(Q)deploy/install.sh "$(DESTDIR)" "$(PREFIX)"

dist: all
	$(Q)deploy/dist.sh $(VERSION)

# libFuzzer targets (tests/fuzz/fuzz_*.c, clang + ASan, host engine only) in $(B)/fuzz/bin; the system
# test tests/system/61-fuzz.sh runs each for a fixed time over tests/fuzz/corpus/<target>.
FUZZ_B := $(B)/fuzz
FUZZ_BINS := $(patsubst tests/fuzz/%.c,$(FUZZ_B)/bin/%,$(wildcard tests/fuzz/fuzz_*.c))
fuzz:
	$(Q)$(MAKE) --no-print-directory B=$(FUZZ_B) CC=clang WITH_CUDA=0 ASAN=1 \
	  ASAN_FLAGS="-fsanitize=address,fuzzer-no-link -fno-omit-frame-pointer" $(FUZZ_B)/lib/libepdengine.a
	$(Q)$(MAKE) --no-print-directory FUZZ_LINK=1 $(FUZZ_BINS)
ifeq ($(FUZZ_LINK),1)
$(FUZZ_B)/bin/%: tests/fuzz/%.c $(FUZZ_B)/lib/libepdengine.a
	$(call msg,FUZZ,$@)
	$(Q)mkdir -p $(@D) && clang -std=gnu11 -g -O1 -fsanitize=address,fuzzer -Iinclude/epd -Iclient -Idaemon -I$(FUZZ_B)/gen \
	  $(PKG_CFLAGS) -DEPD_WITH_CUDA=0 $< $(FUZZ_B)/lib/libepdengine.a -o $@ $(PKG_LIBS) -pthread -ldl -lm
endif

# Every C, CUDA and header file but generated ones; tests/system/02-format.sh checks them.
FORMAT_FILES = $(filter-out tests/gpu/test_plumb_dev_ptx.h,$(wildcard client/*.[ch] client/*.cu include/epd/*.h daemon/*/*.[ch] \
  kernels/*.cu kernels/*.cuh kernels/*.h tests/*.[ch] tests/*/*.[ch] tests/*/*.cu bench/*.[ch] bench/*/*.[ch] \
  bench/*/*.cu))
format:
	$(Q)clang-format -i $(FORMAT_FILES)
format-files:
	@echo $(FORMAT_FILES)

clean:
	$(Q)rm -rf $(B)

-include $(shell find $(B)/obj $(B)/obj-hooks -name '*.d' 2>/dev/null)
