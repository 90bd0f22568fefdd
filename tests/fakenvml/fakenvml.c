/*
 * A fake libnvidia-ml.so.1 for gpuguard's tests: the NVML entry points pynvml calls
 * for what gpuguard reads (src/gpuguard/host/inventory.py), answered from a text file
 * beside the library, fakenvml.conf, read again at each nvmlInit. Not NVIDIA's code:
 * the names, return codes and structure layouts follow the public nvml.h.
 *
 * fakenvml.conf, one statement a line ('#' starts a comment):
 *   driver 580.82.07                     nvmlSystemGetDriverVersion
 *   init_error 9                         nvmlInit returns this code
 *                                        (9 NVML_ERROR_DRIVER_NOT_LOADED, 999 UNKNOWN)
 *   count_error 999                      nvmlDeviceGetCount returns this code
 *   init_sleep 3600                      nvmlInit first sleeps (a driver that hangs)
 *   gpu UUID MINOR BUSID CODE NAME...    one GPU, in index order; CODE 0, or what every
 *                                        call about it returns (15 NVML_ERROR_GPU_IS_LOST)
 *   mig UUID GI CI                       a MIG device of the GPU above (MIG mode on)
 * No file: nvmlInit returns NVML_ERROR_DRIVER_NOT_LOADED, as without the kernel module.
 *
 * Build: gcc -shared -fPIC -O2 -Wall -o libnvidia-ml.so.1 fakenvml.c
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_DRIVER_NOT_LOADED 9
#define NVML_ERROR_GPU_IS_LOST 15
#define NVML_ERROR_UNKNOWN 999

#define MAX_GPUS 64
#define MAX_MIGS 8

struct fake_dev {
    int is_mig;
    int index;
    char uuid[96];
    unsigned minor;
    char bus_id[32];
    int code;
    char name[96];
    unsigned gi, ci;
    struct fake_dev *parent;
    int nmig;
    struct fake_dev *migs[MAX_MIGS];
};

/* The public nvmlPciInfo_t (v3): legacy bus id, ids, then the 32-byte bus id. */
typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

static struct fake_dev gpus[MAX_GPUS];
static struct fake_dev migs[MAX_GPUS * MAX_MIGS];
static int ngpus, nmigs, inited, init_error, count_error, init_sleep;
static char driver[80];

static void conf_path(char *out, size_t n) {
    Dl_info info;
    static char real[4096];
    const char *self = "";
    if (dladdr((void *)conf_path, &info) && info.dli_fname) self = info.dli_fname;
    /* loaded by descriptor (dlopen("/proc/self/fd/N"), as gpuguard does): the file's
       own directory is where that link leads */
    if (strncmp(self, "/proc/self/fd/", 14) == 0 && realpath(self, real)) self = real;
    const char *slash = strrchr(self, '/');
    int dir = slash ? (int)(slash - self) : 1;
    snprintf(out, n, "%.*s/fakenvml.conf", dir, slash ? self : ".");
}

static int load(void) {
    char path[4096], line[512];
    conf_path(path, sizeof path);
    FILE *f = fopen(path, "r");
    ngpus = nmigs = init_error = count_error = init_sleep = 0;
    strcpy(driver, "0.0");
    if (!f) return NVML_ERROR_DRIVER_NOT_LOADED;
    while (fgets(line, sizeof line, f)) {
        char *hash = strchr(line, '#');
        if (hash) *hash = 0;
        line[strcspn(line, "\n")] = 0;
        struct fake_dev *d;
        int pos = 0;
        if (sscanf(line, " driver %79s", driver) == 1) continue;
        if (sscanf(line, " init_error %d", &init_error) == 1) continue;
        if (sscanf(line, " count_error %d", &count_error) == 1) continue;
        if (sscanf(line, " init_sleep %d", &init_sleep) == 1) continue;
        if (ngpus < MAX_GPUS && (d = &gpus[ngpus]) &&
            sscanf(line, " gpu %95s %u %31s %d %n", d->uuid, &d->minor, d->bus_id, &d->code,
                   &pos) == 4) {
            memset(d->name, 0, sizeof d->name);
            snprintf(d->name, sizeof d->name, "%s", pos ? line + pos : "");
            if (!d->name[0]) strcpy(d->name, "Fake GPU");
            d->is_mig = 0;
            d->index = ngpus++;
            d->nmig = 0;
            continue;
        }
        if (ngpus > 0 && nmigs < MAX_GPUS * MAX_MIGS && (d = &migs[nmigs]) &&
            sscanf(line, " mig %95s %u %u", d->uuid, &d->gi, &d->ci) == 3) {
            struct fake_dev *p = &gpus[ngpus - 1];
            if (p->nmig >= MAX_MIGS) continue;
            d->is_mig = 1;
            d->parent = p;
            d->index = p->nmig;
            d->code = 0;
            p->migs[p->nmig++] = d;
            nmigs++;
        }
    }
    fclose(f);
    if (init_sleep > 0) sleep((unsigned)init_sleep);
    return init_error;
}

static int copy_out(char *buf, unsigned len, const char *s) {
    if (!buf) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(s) + 1 > len) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(buf, s);
    return NVML_SUCCESS;
}

/* A handle this library gave out, usable now: else the code to return. */
static int check(struct fake_dev *d) {
    if (!inited) return NVML_ERROR_UNINITIALIZED;
    if (!d) return NVML_ERROR_INVALID_ARGUMENT;
    if (d->is_mig) return d->parent->code;
    return d->code;
}

int nvmlInitWithFlags(unsigned flags) {
    (void)flags;
    int rc = load();
    if (rc == NVML_SUCCESS) inited++;
    return rc;
}
int nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
int nvmlInit(void) { return nvmlInitWithFlags(0); }

int nvmlShutdown(void) {
    if (!inited) return NVML_ERROR_UNINITIALIZED;
    inited--;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(int rc) {
    switch (rc) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

int nvmlSystemGetDriverVersion(char *buf, unsigned len) {
    if (!inited) return NVML_ERROR_UNINITIALIZED;
    return copy_out(buf, len, driver);
}

int nvmlDeviceGetCount_v2(unsigned *count) {
    if (!inited) return NVML_ERROR_UNINITIALIZED;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    if (count_error) return count_error;
    *count = (unsigned)ngpus;
    return NVML_SUCCESS;
}
int nvmlDeviceGetCount(unsigned *count) { return nvmlDeviceGetCount_v2(count); }

int nvmlDeviceGetHandleByIndex_v2(unsigned i, struct fake_dev **out) {
    if (!inited) return NVML_ERROR_UNINITIALIZED;
    if (!out || i >= (unsigned)ngpus) return NVML_ERROR_INVALID_ARGUMENT;
    if (gpus[i].code) return gpus[i].code;
    *out = &gpus[i];
    return NVML_SUCCESS;
}
int nvmlDeviceGetHandleByIndex(unsigned i, struct fake_dev **out) {
    return nvmlDeviceGetHandleByIndex_v2(i, out);
}

int nvmlDeviceGetUUID(struct fake_dev *d, char *buf, unsigned len) {
    int rc = check(d);
    return rc ? rc : copy_out(buf, len, d->uuid);
}

int nvmlDeviceGetName(struct fake_dev *d, char *buf, unsigned len) {
    int rc = check(d);
    return rc ? rc : copy_out(buf, len, d->is_mig ? d->parent->name : d->name);
}

int nvmlDeviceGetIndex(struct fake_dev *d, unsigned *out) {
    int rc = check(d);
    if (rc) return rc;
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    *out = (unsigned)(d->is_mig ? d->parent->index : d->index);
    return NVML_SUCCESS;
}

int nvmlDeviceGetMinorNumber(struct fake_dev *d, unsigned *out) {
    int rc = check(d);
    if (rc) return rc;
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    *out = d->is_mig ? d->parent->minor : d->minor;
    return NVML_SUCCESS;
}

int nvmlDeviceGetPciInfo_v3(struct fake_dev *d, nvmlPciInfo_t *pci) {
    int rc = check(d);
    if (rc) return rc;
    if (!pci || d->is_mig) return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busId, sizeof pci->busId, "%s", d->bus_id);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%.15s", d->bus_id);
    sscanf(d->bus_id, "%x:%x:%x", &pci->domain, &pci->bus, &pci->device);
    pci->pciDeviceId = 0x20b010de;
    return NVML_SUCCESS;
}
int nvmlDeviceGetPciInfo_v2(struct fake_dev *d, nvmlPciInfo_t *pci) {
    return nvmlDeviceGetPciInfo_v3(d, pci);
}
int nvmlDeviceGetPciInfo(struct fake_dev *d, nvmlPciInfo_t *pci) {
    return nvmlDeviceGetPciInfo_v3(d, pci);
}

int nvmlDeviceGetMigMode(struct fake_dev *d, unsigned *current, unsigned *pending) {
    int rc = check(d);
    if (rc) return rc;
    if (!current || !pending || d->is_mig) return NVML_ERROR_INVALID_ARGUMENT;
    *current = *pending = d->nmig > 0;
    return NVML_SUCCESS;
}

int nvmlDeviceGetMaxMigDeviceCount(struct fake_dev *d, unsigned *out) {
    int rc = check(d);
    if (rc) return rc;
    if (!out || d->is_mig) return NVML_ERROR_INVALID_ARGUMENT;
    *out = MAX_MIGS;
    return NVML_SUCCESS;
}

int nvmlDeviceGetMigDeviceHandleByIndex(struct fake_dev *d, unsigned i, struct fake_dev **out) {
    int rc = check(d);
    if (rc) return rc;
    if (!out || d->is_mig || i >= MAX_MIGS) return NVML_ERROR_INVALID_ARGUMENT;
    if (i >= (unsigned)d->nmig) return NVML_ERROR_NOT_FOUND;
    *out = d->migs[i];
    return NVML_SUCCESS;
}

int nvmlDeviceGetGpuInstanceId(struct fake_dev *d, unsigned *out) {
    int rc = check(d);
    if (rc) return rc;
    if (!out || !d->is_mig) return NVML_ERROR_INVALID_ARGUMENT;
    *out = d->gi;
    return NVML_SUCCESS;
}

int nvmlDeviceGetComputeInstanceId(struct fake_dev *d, unsigned *out) {
    int rc = check(d);
    if (rc) return rc;
    if (!out || !d->is_mig) return NVML_ERROR_INVALID_ARGUMENT;
    *out = d->ci;
    return NVML_SUCCESS;
}
