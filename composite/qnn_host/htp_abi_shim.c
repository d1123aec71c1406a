/*
 * libQnnHtp.so stand-in that adapts ExecuTorch 1.5.1's QNN 2.37 ABI to newer HTP host libraries.
 *
 * ExecuTorch writes the HTP *device* custom config payload (socModel, arch, ...) at byte 4 of the
 * struct; QNN >= 2.4x libraries read it at byte 8 (their union gained an 8-byte-aligned member).
 * This library loads the real libQnnHtp.so by the full path in COMPOSITE_QNN_REAL_HTP, hands out a
 * copy of its interface provider whose deviceCreate moves each payload to byte 8, and otherwise
 * forwards everything. No QNN header is needed: only the few fields touched are declared.
 *
 * Link with -Wl,-z,nodelete: ExecuTorch dlcloses the backend library between programs, and a later
 * dlopen("libQnnHtp.so") would otherwise find the still-loaded real library by its soname.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "qnn_interface_layout.h"

typedef uint64_t qnn_error_t;
typedef qnn_error_t (*get_providers_fn)(const void ***providers, uint32_t *count);
typedef qnn_error_t (*device_create_fn)(void *logger, const void **configs, void **device);

enum {
  PROVIDER_FUNCTIONS_OFFSET = COMPOSITE_QNN_FUNCTION_TABLE_OFFSET,
  DEVICE_CREATE_INDEX = COMPOSITE_QNN_DEVICE_CREATE_INDEX,
  PROVIDER_COPY_BYTES = COMPOSITE_QNN_FUNCTION_TABLE_OFFSET + 8 * 160, /* every slot ExecuTorch can read */
  MAX_PROVIDERS = 8,
  MAX_DEVICE_CONFIGS = 64,
  DEVICE_CONFIG_OPTION_CUSTOM = 0,
  OLD_PAYLOAD_OFFSET = COMPOSITE_QNN_OLD_PAYLOAD_OFFSET,
  NEW_PAYLOAD_OFFSET = COMPOSITE_QNN_NEW_PAYLOAD_OFFSET,
  PAYLOAD_BYTES = 8,                        /* largest member of the 2.37 union */
};

struct device_config { /* QnnDevice_Config_t: option, then a pointer-sized union */
  uint32_t option;
  void *custom;
};

static void *real_library;
static unsigned char provider_copies[MAX_PROVIDERS][PROVIDER_COPY_BYTES] __attribute__((aligned(8)));
static const void *provider_list[MAX_PROVIDERS];
static device_create_fn real_device_create[MAX_PROVIDERS];

static qnn_error_t translated_device_create(int provider, void *logger, const void **configs,
                                            void **device) {
  if (configs == NULL) return real_device_create[provider](logger, configs, device);
  struct device_config moved[MAX_DEVICE_CONFIGS];
  unsigned char payloads[MAX_DEVICE_CONFIGS][NEW_PAYLOAD_OFFSET + PAYLOAD_BYTES];
  const void *list[MAX_DEVICE_CONFIGS + 1];
  int n = 0;
  for (; configs[n] != NULL; ++n) {
    if (n == MAX_DEVICE_CONFIGS) {
      fprintf(stderr, "composite qnn shim: more than %d device configs\n", MAX_DEVICE_CONFIGS);
      return 1;
    }
    const struct device_config *config = configs[n];
    moved[n] = *config;
    if (config->option == DEVICE_CONFIG_OPTION_CUSTOM && config->custom != NULL) {
      memset(payloads[n], 0, sizeof payloads[n]);
      memcpy(payloads[n], config->custom, 4);
      memcpy(payloads[n] + NEW_PAYLOAD_OFFSET, (const unsigned char *)config->custom + OLD_PAYLOAD_OFFSET,
             PAYLOAD_BYTES);
      moved[n].custom = payloads[n];
    }
    list[n] = &moved[n];
  }
  list[n] = NULL;
  return real_device_create[provider](logger, list, device);
}

#define PROVIDER_TRAMPOLINE(i)                                                                  \
  static qnn_error_t device_create_##i(void *logger, const void **configs, void **device) { \
    return translated_device_create(i, logger, configs, device);                             \
  }
PROVIDER_TRAMPOLINE(0)
PROVIDER_TRAMPOLINE(1)
PROVIDER_TRAMPOLINE(2)
PROVIDER_TRAMPOLINE(3)
PROVIDER_TRAMPOLINE(4)
PROVIDER_TRAMPOLINE(5)
PROVIDER_TRAMPOLINE(6)
PROVIDER_TRAMPOLINE(7)
static const device_create_fn trampolines[MAX_PROVIDERS] = {
    device_create_0, device_create_1, device_create_2, device_create_3,
    device_create_4, device_create_5, device_create_6, device_create_7,
};

qnn_error_t QnnInterface_getProviders(const void ***providers, uint32_t *count) {
  if (real_library == NULL) {
    const char *path = getenv("COMPOSITE_QNN_REAL_HTP");
    if (path == NULL || path[0] == '\0') {
      fprintf(stderr, "composite qnn shim: COMPOSITE_QNN_REAL_HTP is not set\n");
      return 1;
    }
    /* The real library announces its TLS configuration on stdout when it loads; keep stdout for
     * the program's own output (JSON stats, generated text). */
    fflush(stdout);
    int saved_stdout = dup(1);
    dup2(2, 1);
    real_library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    fflush(stdout);
    dup2(saved_stdout, 1);
    close(saved_stdout);
    if (real_library == NULL) {
      fprintf(stderr, "composite qnn shim: %s\n", dlerror());
      return 1;
    }
  }
  get_providers_fn real_get = (get_providers_fn)dlsym(real_library, "QnnInterface_getProviders");
  if (real_get == NULL) return 1;
  const void **real_providers = NULL;
  uint32_t n = 0;
  qnn_error_t status = real_get(&real_providers, &n);
  if (status != 0) return status;
  if (n > MAX_PROVIDERS) n = MAX_PROVIDERS;
  for (uint32_t i = 0; i < n; ++i) {
    memcpy(provider_copies[i], real_providers[i], PROVIDER_COPY_BYTES);
    device_create_fn *slot =
        (device_create_fn *)(provider_copies[i] + PROVIDER_FUNCTIONS_OFFSET) + DEVICE_CREATE_INDEX;
    real_device_create[i] = *slot;
    *slot = trampolines[i];
    provider_list[i] = provider_copies[i];
  }
  *providers = provider_list;
  *count = n;
  return 0;
}

