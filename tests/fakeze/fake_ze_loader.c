/*
 * fake_ze_loader.c - a fake Level Zero loader (libze_loader.so.1) for tests of gpusd's Intel backend.
 *
 * It implements the Sysman (zes*) calls gpusd makes through the real `pyzes` Python bindings
 * (PyPI, Intel's ctypes layer), with the structure layouts of zes_api.h as pyzes declares them
 * (fake_ze_sizeof() lets the suite compare).  pyzes resolves a function only when it is called,
 * so no stubs are needed.  What is faked: the loader and the GPU driver under it (a real loader
 * would dispatch to libze_intel_gpu.so); what is real: pyzes and gpusd's calls through it.
 *
 * The fake GPUs come from the file named by GPUSD_FAKE_ZE_STATE (re-read when it changes), one
 * record a line, fields separated by '|':
 *   init|<result>                      zesInit answers <result> (e.g. 2013265921 = UNINITIALIZED)
 *   gpu|name=Intel(R) Data Center GPU Max 1550|uuid=<32 hex>|bdf=0000:29:00.0|mem_total=<bytes>|
 *      mem_used=<bytes>|util=37|temp=45|power=300|limit=600|subdevices=2|lost=<result>|missing=a,b
 *   proc|pid=123|mem=<bytes>           (a process on the GPU above)
 * Engine activity and energy are counters: activeTime = util% of the time stamp, energy = power x
 * time, so two readings give back util and power.  missing: memory, engine, temp, power, limit,
 * processes, pci (the enumeration returns none / the call answers UNSUPPORTED_FEATURE).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#define EXPORT __attribute__((visibility("default")))
#define MAX_GPUS 64
#define MAX_PROCS 64
typedef uint32_t res_t;
enum { OK = 0, UNINIT = 0x78000001, UNSUPPORTED = 0x78000003, BAD_ARG = 0x78000004, NULL_HANDLE = 0x78000005 };

typedef struct { int32_t stype; void *pNext; int32_t type; uint32_t vendorId, deviceId, flags, subdeviceId,
                 coreClockRate; uint64_t maxMemAllocSize; uint32_t maxHardwareContexts, maxCommandQueuePriority,
                 numThreadsPerEU, physicalEUSimdWidth, numEUsPerSubslice, numSubslicesPerSlice, numSlices;
                 uint64_t timerResolution; uint32_t timestampValidBits, kernelTimestampValidBits;
                 uint8_t uuid[16]; char name[256]; } ze_props_t;
typedef struct { int32_t stype; void *pNext; ze_props_t core; uint32_t numSubdevices; char serialNumber[64],
                 boardNumber[64], brandName[64], modelName[64], vendorName[64], driverVersion[64]; } dev_props_t;
typedef struct { int32_t stype; void *pNext; uint32_t domain, bus, device, function; int32_t gen, width;
                 int64_t maxBandwidth; uint8_t bw, pkt, replay; } pci_props_t;
typedef struct { int32_t stype; void *pNext; int32_t health; uint64_t free, size; } mem_state_t;
typedef struct { int32_t stype; void *pNext; int32_t type; uint8_t onSub; uint32_t subId; int32_t location;
                 uint64_t physicalSize; int32_t busWidth, numChannels; } mem_props_t;
typedef struct { int32_t stype; void *pNext; uint32_t type; uint8_t onSub; uint32_t subId; } eng_props_t;
typedef struct { uint64_t activeTime, timestamp; } eng_stats_t;
typedef struct { int32_t stype; void *pNext; int32_t type; uint8_t onSub; uint32_t subId; double maxTemperature;
                 uint8_t crit, t1, t2; } temp_props_t;
typedef struct { uint64_t energy, timestamp; } energy_t;
typedef struct { int32_t stype; void *pNext; int32_t level, source, limitUnit; uint8_t enabledStateLocked, enabled,
                 intervalValueLocked; int32_t interval; uint8_t limitValueLocked; int32_t limit; } limit_ext_t;
typedef struct { int32_t stype; void *pNext; uint32_t processId; uint64_t memSize, sharedSize; uint32_t engines; }
    proc_state_t;

_Static_assert(sizeof(dev_props_t) == 776, "zes_device_properties_t");
_Static_assert(sizeof(pci_props_t) == 56, "zes_pci_properties_t");
_Static_assert(sizeof(mem_state_t) == 40, "zes_mem_state_t");
_Static_assert(sizeof(mem_props_t) == 48, "zes_mem_properties_t");
_Static_assert(sizeof(eng_props_t) == 32, "zes_engine_properties_t");
_Static_assert(sizeof(temp_props_t) == 48, "zes_temp_properties_t");
_Static_assert(sizeof(limit_ext_t) == 48, "zes_power_limit_ext_desc_t");
_Static_assert(sizeof(proc_state_t) == 48, "zes_process_state_t");

typedef struct { uint32_t pid; uint64_t mem; } proc_t;
typedef struct {
    char name[128], uuid[40], missing[256];
    unsigned domain, bus, dev, fn;
    uint64_t mem_total, mem_used; uint32_t util, subdevices; double temp; uint64_t power; int32_t limit;
    res_t lost; int nproc; proc_t procs[MAX_PROCS];
} gpu_t;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static gpu_t g_gpu[MAX_GPUS];
static int g_count, g_inited;
static res_t g_init_result;
static struct stat g_seen;
static char g_driver, g_mem[MAX_GPUS], g_eng[MAX_GPUS], g_temp[MAX_GPUS], g_pwr[MAX_GPUS];

EXPORT size_t fake_ze_sizeof(const char *what) {
    if (!strcmp(what, "zes_device_properties_t")) return sizeof(dev_props_t);
    if (!strcmp(what, "zes_process_state_t")) return sizeof(proc_state_t);
    if (!strcmp(what, "zes_power_limit_ext_desc_t")) return sizeof(limit_ext_t);
    return 0;
}

static void copy(char *dst, size_t n, const char *src) { snprintf(dst, n, "%s", src); }

static void field(gpu_t *g, proc_t *p, char *kv) {
    char *eq = strchr(kv, '=');
    if (!eq) return;
    *eq = 0;
    const char *k = kv, *v = eq + 1;
    if (p) {
        if (!strcmp(k, "pid")) p->pid = (uint32_t)strtoul(v, 0, 10);
        else if (!strcmp(k, "mem")) p->mem = strtoull(v, 0, 10);
        return;
    }
    if (!strcmp(k, "name")) copy(g->name, sizeof g->name, v);
    else if (!strcmp(k, "uuid")) copy(g->uuid, sizeof g->uuid, v);
    else if (!strcmp(k, "bdf")) sscanf(v, "%x:%x:%x.%x", &g->domain, &g->bus, &g->dev, &g->fn);
    else if (!strcmp(k, "mem_total")) g->mem_total = strtoull(v, 0, 10);
    else if (!strcmp(k, "mem_used")) g->mem_used = strtoull(v, 0, 10);
    else if (!strcmp(k, "util")) g->util = (uint32_t)strtoul(v, 0, 10);
    else if (!strcmp(k, "temp")) g->temp = strtod(v, 0);
    else if (!strcmp(k, "power")) g->power = strtoull(v, 0, 10);
    else if (!strcmp(k, "limit")) g->limit = (int32_t)strtol(v, 0, 10);
    else if (!strcmp(k, "subdevices")) g->subdevices = (uint32_t)strtoul(v, 0, 10);
    else if (!strcmp(k, "lost")) g->lost = (res_t)strtoul(v, 0, 10);
    else if (!strcmp(k, "missing")) snprintf(g->missing, sizeof g->missing, ",%s,", v);
}

static void refresh(void) {
    const char *path = getenv("GPUSD_FAKE_ZE_STATE");
    struct stat st;
    if (!path || stat(path, &st) != 0) { g_count = 0; return; }
    if (st.st_mtim.tv_sec == g_seen.st_mtim.tv_sec && st.st_mtim.tv_nsec == g_seen.st_mtim.tv_nsec &&
        st.st_size == g_seen.st_size && st.st_ino == g_seen.st_ino) return;
    g_seen = st;
    FILE *f = fopen(path, "r");
    if (!f) { g_count = 0; return; }
    char line[4096];
    int n = -1;
    g_init_result = OK;
    memset(g_gpu, 0, sizeof g_gpu);
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\r\n")] = 0;
        char *save = 0, *kind = strtok_r(line, "|", &save);
        if (!kind) continue;
        if (!strcmp(kind, "init")) { char *v = strtok_r(0, "|", &save); g_init_result = v ? (res_t)strtoul(v, 0, 10) : OK; continue; }
        proc_t *p = 0;
        if (!strcmp(kind, "gpu")) { if (n + 1 >= MAX_GPUS) break; n++; }
        else if (!strcmp(kind, "proc") && n >= 0 && g_gpu[n].nproc < MAX_PROCS) p = &g_gpu[n].procs[g_gpu[n].nproc++];
        else continue;
        for (char *kv; (kv = strtok_r(0, "|", &save));) field(&g_gpu[n], p, kv);
    }
    fclose(f);
    g_count = n + 1;
}

static uint64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* Lock; the GPU behind handle h (one of the arrays `base`), checking init, loss and missing fields. */
static res_t enter(void *h, const char *base, const char *what, gpu_t **g) {
    pthread_mutex_lock(&g_mu);
    if (!g_inited) return UNINIT;
    refresh();
    const char *c = (const char *)h;
    const char *start = base ? base : (const char *)g_gpu;
    long i = base ? c - start : ((const gpu_t *)h - g_gpu);
    if (!h || i < 0 || i >= g_count) return NULL_HANDLE;
    gpu_t *d = &g_gpu[i];
    if (d->lost) return d->lost;
    char key[64];
    snprintf(key, sizeof key, ",%s,", what);
    if (what[0] && strstr(d->missing, key)) return UNSUPPORTED;
    *g = d;
    return OK;
}
#define LEAVE(rc) do { res_t rc_ = (rc); pthread_mutex_unlock(&g_mu); return rc_; } while (0)

EXPORT res_t zesInit(uint32_t flags) {
    (void)flags;
    pthread_mutex_lock(&g_mu);
    memset(&g_seen, 0, sizeof g_seen);
    refresh();
    if (g_init_result != OK) LEAVE(g_init_result);
    g_inited = 1;
    LEAVE(OK);
}

EXPORT res_t zesDriverGet(uint32_t *count, void **drivers) {
    pthread_mutex_lock(&g_mu);
    if (!g_inited) LEAVE(UNINIT);
    if (!count) LEAVE(BAD_ARG);
    if (drivers && *count >= 1) drivers[0] = &g_driver;
    *count = 1;
    LEAVE(OK);
}

EXPORT res_t zesDeviceGet(void *driver, uint32_t *count, void **devices) {
    pthread_mutex_lock(&g_mu);
    if (!g_inited) LEAVE(UNINIT);
    refresh();
    if (driver != &g_driver || !count) LEAVE(BAD_ARG);
    if (devices) {
        uint32_t n = *count < (uint32_t)g_count ? *count : (uint32_t)g_count;
        for (uint32_t i = 0; i < n; i++) devices[i] = &g_gpu[i];
    }
    *count = (uint32_t)g_count;
    LEAVE(OK);
}

static int hexval(char c) { return c >= '0' && c <= '9' ? c - '0' : (c | 32) >= 'a' && (c | 32) <= 'f' ? (c | 32) - 'a' + 10 : -1; }

EXPORT res_t zesDeviceGetProperties(void *h, dev_props_t *p) {
    gpu_t *g;
    res_t rc = enter(h, 0, "", &g);
    if (rc == OK) {
        int32_t stype = p->stype;
        void *next = p->pNext;
        memset(p, 0, sizeof *p);
        p->stype = stype, p->pNext = next;
        p->core.type = 1;  /* ZE_DEVICE_TYPE_GPU */
        p->core.vendorId = 0x8086;
        p->core.deviceId = 0x0bd5;
        for (int i = 0; i < 16 && g->uuid[2 * i] && g->uuid[2 * i + 1]; i++)
            p->core.uuid[i] = (uint8_t)(hexval(g->uuid[2 * i]) << 4 | hexval(g->uuid[2 * i + 1]));
        copy(p->core.name, sizeof p->core.name, g->name);
        copy(p->modelName, sizeof p->modelName, g->name);
        copy(p->vendorName, sizeof p->vendorName, "Intel(R) Corporation");
        copy(p->driverVersion, sizeof p->driverVersion, "1.3.29735+27");
        copy(p->serialNumber, sizeof p->serialNumber, "unknown");
        p->numSubdevices = g->subdevices;
    }
    LEAVE(rc);
}

EXPORT res_t zesDevicePciGetProperties(void *h, pci_props_t *p) {
    gpu_t *g;
    res_t rc = enter(h, 0, "pci", &g);
    if (rc == OK) { p->domain = g->domain; p->bus = g->bus; p->device = g->dev; p->function = g->fn; }
    LEAVE(rc);
}

/* One handle of each kind per GPU, or none where the field is missing. */
static res_t enum_one(void *h, const char *what, char *arr, uint32_t *count, void **out) {
    gpu_t *g;
    res_t rc = enter(h, 0, "", &g);
    if (rc == OK) {
        if (!count) LEAVE(BAD_ARG);
        char key[64];
        snprintf(key, sizeof key, ",%s,", what);
        uint32_t n = strstr(g->missing, key) ? 0 : 1;
        if (out && *count >= 1 && n) out[0] = &arr[g - g_gpu];
        *count = n;
    }
    LEAVE(rc);
}

EXPORT res_t zesDeviceEnumMemoryModules(void *h, uint32_t *c, void **o) { return enum_one(h, "memory", g_mem, c, o); }
EXPORT res_t zesDeviceEnumEngineGroups(void *h, uint32_t *c, void **o) { return enum_one(h, "engine", g_eng, c, o); }
EXPORT res_t zesDeviceEnumTemperatureSensors(void *h, uint32_t *c, void **o) { return enum_one(h, "temp", g_temp, c, o); }
EXPORT res_t zesDeviceEnumPowerDomains(void *h, uint32_t *c, void **o) { return enum_one(h, "power", g_pwr, c, o); }

EXPORT res_t zesMemoryGetProperties(void *h, mem_props_t *p) {
    gpu_t *g;
    res_t rc = enter(h, g_mem, "", &g);
    if (rc == OK) { p->type = 0; p->location = 1; p->physicalSize = g->mem_total; }  /* HBM, on the device */
    LEAVE(rc);
}

EXPORT res_t zesMemoryGetState(void *h, mem_state_t *s) {
    gpu_t *g;
    res_t rc = enter(h, g_mem, "", &g);
    if (rc == OK) { s->health = 1; s->size = g->mem_total; s->free = g->mem_total - g->mem_used; }
    LEAVE(rc);
}

EXPORT res_t zesEngineGetProperties(void *h, eng_props_t *p) {
    gpu_t *g;
    res_t rc = enter(h, g_eng, "", &g);
    if (rc == OK) { p->type = 0; p->onSub = 0; }  /* ZES_ENGINE_GROUP_ALL */
    LEAVE(rc);
}

EXPORT res_t zesEngineGetActivity(void *h, eng_stats_t *s) {
    gpu_t *g;
    res_t rc = enter(h, g_eng, "", &g);
    if (rc == OK) { s->timestamp = now_us(); s->activeTime = s->timestamp / 100 * g->util; }
    LEAVE(rc);
}

EXPORT res_t zesTemperatureGetProperties(void *h, temp_props_t *p) {
    gpu_t *g;
    res_t rc = enter(h, g_temp, "", &g);
    if (rc == OK) { p->type = 1; p->maxTemperature = 100.0; }  /* ZES_TEMP_SENSORS_GPU */
    LEAVE(rc);
}

EXPORT res_t zesTemperatureGetState(void *h, double *t) {
    gpu_t *g;
    res_t rc = enter(h, g_temp, "", &g);
    if (rc == OK) *t = g->temp;
    LEAVE(rc);
}

EXPORT res_t zesPowerGetEnergyCounter(void *h, energy_t *e) {
    gpu_t *g;
    res_t rc = enter(h, g_pwr, "", &g);
    if (rc == OK) { e->timestamp = now_us(); e->energy = e->timestamp * g->power; }  /* microjoules */
    LEAVE(rc);
}

EXPORT res_t zesPowerGetLimitsExt(void *h, uint32_t *count, limit_ext_t *out) {
    gpu_t *g;
    res_t rc = enter(h, g_pwr, "limit", &g);
    if (rc == OK) {
        if (!count) LEAVE(BAD_ARG);
        if (out && *count >= 1) {
            out[0].level = 1; out[0].source = 0; out[0].limitUnit = 2;  /* SUSTAINED, ANY, POWER */
            out[0].enabled = 1; out[0].limit = g->limit * 1000;  /* milliwatts */
        }
        *count = 1;
    }
    LEAVE(rc);
}

EXPORT res_t zesDeviceProcessesGetState(void *h, uint32_t *count, proc_state_t *out) {
    gpu_t *g;
    res_t rc = enter(h, 0, "processes", &g);
    if (rc == OK) {
        if (!count) LEAVE(BAD_ARG);
        uint32_t n = (uint32_t)g->nproc;
        if (out) {
            if (*count < n) { *count = n; LEAVE(0x78000008); }  /* INVALID_SIZE */
            for (uint32_t i = 0; i < n; i++) {
                out[i].processId = g->procs[i].pid; out[i].memSize = g->procs[i].mem;
                out[i].sharedSize = 0; out[i].engines = 1;
            }
        }
        *count = n;
    }
    LEAVE(rc);
}
