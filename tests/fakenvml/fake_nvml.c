/*
 * fake_nvml.c - a fake libnvidia-ml.so.1 for tests and benchmarks of gpusd.
 *
 * The real NVML Python bindings (nvidia-ml-py / pynvml), nvitop and gpustat
 * load this library instead of the NVIDIA driver's libnvidia-ml.so.1.  The
 * state of the fake GPUs comes from a text file named by the environment
 * variable GPUSD_FAKE_NVML_STATE; see README.md in this directory for the
 * format and the semantics.
 *
 * Design notes:
 *   - Every exported call takes one global mutex, checks the init refcount,
 *     then checks (stat) whether the state file changed and re-parses it if
 *     so.  No allocation per call; parsing happens only on change.
 *   - Device handles are pointers into static arrays (g_hdev / g_hmig) and so
 *     stay valid across re-reads.  A handle whose device vanished from the
 *     file answers NVML_ERROR_GPU_IS_LOST.
 *   - Struct layouts mirror the ctypes definitions in pynvml.py
 *     (nvidia-ml-py 13.x); fake_nvml_sizeof() exposes sizeof() of each so the
 *     test suite can compare them.
 *
 * Build: cc -O2 -shared -fPIC -Wl,-soname,libnvidia-ml.so.1 \
 *           -o libnvidia-ml.so.1 fake_nvml.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

/* ------------------------------------------------------------------------ */
/* NVML types                                                               */
/* ------------------------------------------------------------------------ */

typedef int nvmlReturn_t;
typedef unsigned long long ull;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_ALREADY_INITIALIZED = 5,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_INSUFFICIENT_POWER = 8,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_IRQ_ISSUE = 11,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_CORRUPTED_INFOROM = 14,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_RESET_REQUIRED = 16,
    NVML_ERROR_OPERATING_SYSTEM = 17,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_IN_USE = 19,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_NO_DATA = 21,
    NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22,
    NVML_ERROR_INSUFFICIENT_RESOURCES = 23,
    NVML_ERROR_FREQ_NOT_SUPPORTED = 24,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_DEPRECATED = 26,
    NVML_ERROR_NOT_READY = 27,
    NVML_ERROR_GPU_NOT_FOUND = 28,
    NVML_ERROR_INVALID_STATE = 29,
    NVML_ERROR_RESET_TYPE_NOT_SUPPORTED = 30,
    NVML_ERROR_UNKNOWN = 999,
};

#define NVML_VALUE_TYPE_UNSIGNED_INT 1
#define NVML_VALUE_TYPE_UNSIGNED_LONG_LONG 3
#define NVML_NO_ID 0xFFFFFFFFu

/* pynvml: nvmlPciInfo_t (used by nvmlDeviceGetPciInfo_v3) */
typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

/* pynvml: nvmlPciInfo_v2_t ("Legacy pciInfo used for _v1 and _v2") */
typedef struct {
    char busId[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    unsigned int reserved0, reserved1, reserved2, reserved3;
} nvmlPciInfo_v2_t;

/* pynvml: nvmlPciInfoExt_v1_t */
typedef struct {
    unsigned int version;
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    unsigned int baseClass;
    unsigned int subClass;
    char busId[32];
} nvmlPciInfoExt_t;
#define nvmlPciInfoExt_v1 0x1000040u

/* pynvml: c_nvmlMemory_t */
typedef struct {
    ull total;
    ull free;
    ull used;
} nvmlMemory_t;

/* pynvml: c_nvmlMemory_v2_t */
typedef struct {
    unsigned int version;
    ull total;
    ull reserved;
    ull free;
    ull used;
} nvmlMemory_v2_t;
#define nvmlMemory_v2 0x02000028u

/* pynvml: c_nvmlBAR1Memory_t */
typedef struct {
    ull bar1Total;
    ull bar1Free;
    ull bar1Used;
} nvmlBAR1Memory_t;

/* nvitop: c_nvmlProcessInfo_v1_t (unversioned nvmlDevice*RunningProcesses) */
typedef struct {
    unsigned int pid;
    ull usedGpuMemory;
} nvmlProcessInfo_v1_t;

/* pynvml: c_nvmlProcessInfo_v2_t == c_nvmlProcessInfo_v3_t */
typedef struct {
    unsigned int pid;
    ull usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

/* pynvml: c_nvmlUtilization_t */
typedef struct {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

/* pynvml: c_nvmlValue_t */
typedef union {
    double dVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    long long sllVal;
    int siVal;
    unsigned short usVal;
} nvmlValue_t;

/* pynvml: c_nvmlSample_t */
typedef struct {
    ull timeStamp;
    nvmlValue_t sampleValue;
} nvmlSample_t;

/* pynvml: c_nvmlFieldValue_t */
typedef struct {
    uint32_t fieldId;
    uint32_t scopeId;
    int64_t timestamp;
    int64_t latencyUsec;
    unsigned int valueType;
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

/* pynvml: c_nvmlTemperature_v1_t */
typedef struct {
    unsigned int version;
    unsigned int sensorType;
    int temperature;
} nvmlTemperature_t;
#define nvmlTemperature_v1 0x100000Cu

/* pynvml: c_nvmlProcessUtilizationSample_t */
typedef struct {
    unsigned int pid;
    ull timeStamp;
    unsigned int smUtil;
    unsigned int memUtil;
    unsigned int encUtil;
    unsigned int decUtil;
} nvmlProcessUtilizationSample_t;

/* ------------------------------------------------------------------------ */
/* Fake state                                                               */
/* ------------------------------------------------------------------------ */

#define MAX_GPUS 64
#define MAX_MIGS 16
#define MAX_PROCS 256
#define MAX_SAMPLES 128
#define MAX_ERRORS 32
#define MAX_LINKS 18      /* NVLinks per GPU (H100: 18) */
#define MAX_CPU_WORDS 16  /* CPU affinity: up to 1024 CPUs */
#define MAX_LINE 8192
#define MAX_FILE (4 * 1024 * 1024)
#define SAMPLE_PERIOD_US 166667ull
#define SYNTH_WINDOW_US 2000000ull
/* Timestamp granularity bound for the "racy" modification check. */
#define RACY_WINDOW_NS 50000000ll

/* presence bits for optional per-device fields */
enum {
    F_NAME, F_UUID, F_SERIAL, F_PCI, F_MINOR, F_ARCH, F_CC,
    F_MEM_TOTAL, F_BAR1, F_UTIL_GPU, F_UTIL_MEM, F_UTIL_SAMPLES,
    F_UTIL_MEM_SAMPLES, F_UTIL_ENC, F_UTIL_DEC, F_TEMP, F_POWER_USAGE,
    F_POWER_LIMIT, F_POWER_DEFAULT_LIMIT, F_FAN, F_PSTATE, F_COMPUTE_MODE,
    F_PERSISTENCE, F_DISPLAY_ACTIVE, F_DISPLAY_MODE, F_CLOCK_SM,
    F_CLOCK_SM_MAX, F_CLOCK_MEM, F_CLOCK_MEM_MAX, F_CLOCK_GR, F_CLOCK_GR_MAX,
    F_CLOCK_VIDEO, F_CLOCK_VIDEO_MAX, F_PCIE_TX, F_PCIE_RX, F_MIG_MODE,
    F_MIG_MAX, F_ECC, F_BRAND, F_NUMA, F_SWITCH, F_BRIDGE, F_CPUS,
};
#define HAS(d, f) (((d)->has >> (f)) & 1ull)

typedef struct {
    unsigned int pid;
    ull mem;
    unsigned int gi, ci;
} fproc_t;

typedef struct {
    unsigned int pid, sm, mem, enc, dec;
} fputil_t;

typedef struct {
    char fn[96];
    int code;
} ferr_t;

typedef struct {
    char profile[32];
    char uuid[96];
    ull mem_total, mem_used;
    unsigned int gi, ci;
} fmig_t;

/* Telemetry for the DCGM-style series (issue 25): energy, PCIe replays, remapped
 * rows, field values and XID events.  Kept in one block so other additions merge. */
#define MAX_FIELDS 48
#define MAX_XIDS 64
typedef struct {
    int has_energy, has_replay, has_remap;
    ull energy;              /* mJ when the file was loaded; grows at power_usage mW */
    long long energy_t0_ns;  /* CLOCK_MONOTONIC at load */
    unsigned int replay;
    unsigned int remap_corr, remap_unc, remap_pending, remap_failure;
    unsigned int nfield;
    unsigned int field_id[MAX_FIELDS], field_scope[MAX_FIELDS];
    ull field_val[MAX_FIELDS];
    int no_events;           /* "xid_events 0": nvmlDeviceRegisterEvents is NOT_SUPPORTED */
    unsigned int nxid;
    ull xid[MAX_XIDS];       /* every XID so far, oldest first; new lines are new events */
    int gpm;                 /* "gpm ..." lines seen: nvmlGpmQueryDeviceSupport says supported */
    unsigned int ngpm;
    unsigned int gpm_id[MAX_FIELDS];
    ull gpm_val[MAX_FIELDS]; /* the metric's value between any two samples (percent, MiB/s) */
} ftel_t;

typedef struct {
    ull has;
    char name[96], uuid[96], serial[32];
    char busid[32], busid_legacy[16];
    unsigned int domain, bus, dev, func, pci_device_id, pci_subsystem_id;
    unsigned int minor, arch, cc_major, cc_minor, brand;
    ull mem_total, mem_used, mem_reserved, bar1_total, bar1_used, ecc;
    unsigned int util_gpu, util_mem, util_enc, util_dec;
    unsigned int nsamples, nmsamples;
    unsigned int samples[MAX_SAMPLES], msamples[MAX_SAMPLES];
    unsigned int temp, power_usage, power_limit, power_default_limit, fan;
    unsigned int pstate, compute_mode, persistence, display_active, display_mode;
    unsigned int clock_sm, clock_sm_max, clock_mem, clock_mem_max;
    unsigned int clock_gr, clock_gr_max, clock_video, clock_video_max;
    unsigned int pcie_tx, pcie_rx;
    unsigned int mig_mode, mig_pending, mig_max;
    unsigned int nmig, nproc, ngproc, nputil, nerr;
    int err_all;
    /* topology (before migs: cleared by a `device` line) */
    unsigned int numa_node, pcie_switch, host_bridge;
    unsigned int nlink, nlevel;
    unsigned int link_dom[MAX_LINKS], link_bus[MAX_LINKS], link_dev[MAX_LINKS], link_fn[MAX_LINKS];
    unsigned int level_peer[MAX_GPUS], level_value[MAX_GPUS];
    ull cpus[MAX_CPU_WORDS];
    ftel_t tel;
    fmig_t migs[MAX_MIGS];
    fproc_t procs[MAX_PROCS];
    fproc_t gprocs[MAX_PROCS];
    fputil_t putil[MAX_PROCS];
    ferr_t errs[MAX_ERRORS];
} fdev_t;

typedef struct {
    int has_driver, has_nvml, has_cuda;
    char driver[80], nvml[80];
    int cuda;
    int init_error;
    unsigned int ndev;
    fdev_t devs[MAX_GPUS];
} fstate_t;

/* Handles: stable static objects.  Physical and MIG handles live in two
 * distinct arrays, so a handle is classified by address range alone. */
typedef struct {
    unsigned int magic;
    unsigned int idx;
} hdev_t;
typedef struct {
    unsigned int magic;
    unsigned int parent;
    unsigned int idx;
} hmig_t;

static hdev_t g_hdev[MAX_GPUS];
static hmig_t g_hmig[MAX_GPUS][MAX_MIGS];

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_refcount = 0;

static fstate_t g_states[2];
static fstate_t *g_cur = NULL; /* NULL until a state file was parsed */
static char g_raws[2][MAX_FILE];
static char *g_raw_cur = g_raws[0];
static char *g_raw_tmp = g_raws[1];
static size_t g_raw_len = 0;

/* identity of the loaded state file */
static char g_path[4096];
static dev_t g_st_dev;
static ino_t g_st_ino;
static off_t g_st_size;
static long long g_st_mtime, g_st_ctime;
static int g_racy;

/* per-(device, sampling type) memory of the last sample grid, so that the
 * two calls of a size-query + fetch sequence see the same set of samples */
static ull g_grid_last[MAX_GPUS][16];
static ull g_grid_wall[MAX_GPUS][16];

/* ------------------------------------------------------------------------ */
/* small helpers                                                            */
/* ------------------------------------------------------------------------ */

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

static ull now_us(void) { return (ull)(now_ns() / 1000); }

static long long mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

static void init_handles(void)
{
    static int done = 0;
    if (done)
        return;
    for (unsigned i = 0; i < MAX_GPUS; i++) {
        g_hdev[i].magic = 0x6e766d6c; /* "nvml" */
        g_hdev[i].idx = i;
        for (unsigned j = 0; j < MAX_MIGS; j++) {
            g_hmig[i][j].magic = 0x6d696721; /* "mig!" */
            g_hmig[i][j].parent = i;
            g_hmig[i][j].idx = j;
        }
    }
    done = 1;
}

static nvmlReturn_t put_str(char *dst, unsigned int len, const char *src)
{
    size_t n = strlen(src);
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((size_t)len < n + 1)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, n + 1);
    return NVML_SUCCESS;
}

/* "dddddddd:bb:dd.f", "dddd:bb:dd.f" or "bb:dd.f" (hex) */
static int parse_busid(const char *s, unsigned *dom, unsigned *bus, unsigned *dev, unsigned *fn)
{
    unsigned a, b, c, d;
    char extra;
    if (sscanf(s, "%x:%x:%x.%x%c", &a, &b, &c, &d, &extra) == 4) {
        *dom = a; *bus = b; *dev = c; *fn = d;
        return 0;
    }
    if (sscanf(s, "%x:%x.%x%c", &b, &c, &d, &extra) == 3) {
        *dom = 0; *bus = b; *dev = c; *fn = d;
        return 0;
    }
    return -1;
}

/* ------------------------------------------------------------------------ */
/* state file parser                                                        */
/* ------------------------------------------------------------------------ */

static int parse_u64(const char *tok, ull *out)
{
    char *end;
    if (!tok || !*tok || *tok == '-')
        return -1;
    errno = 0;
    ull v = strtoull(tok, &end, 0);
    if (errno || *end)
        return -1;
    *out = v;
    return 0;
}

static int parse_u32(const char *tok, unsigned *out)
{
    ull v;
    if (parse_u64(tok, &v) || v > 0xFFFFFFFFull)
        return -1;
    *out = (unsigned)v;
    return 0;
}

static int parse_i32(const char *tok, int *out)
{
    char *end;
    if (!tok || !*tok)
        return -1;
    errno = 0;
    long v = strtol(tok, &end, 0);
    if (errno || *end || v < -2147483647l - 1 || v > 2147483647l)
        return -1;
    *out = (int)v;
    return 0;
}

static int copy_str(char *dst, size_t cap, const char *src)
{
    size_t n = strlen(src);
    if (n == 0 || n >= cap)
        return -1;
    memcpy(dst, src, n + 1);
    return 0;
}

#define MAX_TOK 160

/* parse `len` bytes of `buf` into `st`; 0 on success, else the line number */
/* Telemetry lines (issue 25).  Returns 0 when `key` is not one of them, 1 when it
 * was parsed, -1 when it is malformed. */
static long long mono_ns(void);
static int parse_tel(fdev_t *d, const char *key, char **tok, int nt)
{
    ftel_t *t;
    if (strcmp(key, "energy") && strcmp(key, "pcie_replay") && strcmp(key, "remapped_rows") &&
        strcmp(key, "field") && strcmp(key, "xid") && strcmp(key, "xid_events") && strcmp(key, "gpm"))
        return 0;
    if (!d)
        return -1;
    t = &d->tel;
    if (!strcmp(key, "energy")) {
        if (nt != 1 || parse_u64(tok[0], &t->energy))
            return -1;
        t->has_energy = 1;
        t->energy_t0_ns = mono_ns();
    } else if (!strcmp(key, "pcie_replay")) {
        if (nt != 1 || parse_u32(tok[0], &t->replay))
            return -1;
        t->has_replay = 1;
    } else if (!strcmp(key, "remapped_rows")) {
        if (nt < 2 || nt > 4 || parse_u32(tok[0], &t->remap_corr) || parse_u32(tok[1], &t->remap_unc))
            return -1;
        t->remap_pending = t->remap_failure = 0;
        if (nt > 2 && parse_u32(tok[2], &t->remap_pending))
            return -1;
        if (nt > 3 && parse_u32(tok[3], &t->remap_failure))
            return -1;
        t->has_remap = 1;
    } else if (!strcmp(key, "field")) {
        unsigned k = t->nfield;
        if ((nt != 2 && nt != 3) || k >= MAX_FIELDS || parse_u32(tok[0], &t->field_id[k]) ||
            parse_u64(tok[1], &t->field_val[k]))
            return -1;
        t->field_scope[k] = 0;
        if (nt == 3 && parse_u32(tok[2], &t->field_scope[k]))
            return -1;
        t->nfield++;
    } else if (!strcmp(key, "xid")) {
        if (nt != 1 || t->nxid >= MAX_XIDS || parse_u64(tok[0], &t->xid[t->nxid]))
            return -1;
        t->nxid++;
    } else if (!strcmp(key, "gpm")) {
        unsigned k = t->ngpm;
        if (nt != 2 || k >= MAX_FIELDS || parse_u32(tok[0], &t->gpm_id[k]) || parse_u64(tok[1], &t->gpm_val[k]))
            return -1;
        t->ngpm++;
        t->gpm = 1;
    } else { /* xid_events */
        unsigned v;
        if (nt != 1 || parse_u32(tok[0], &v))
            return -1;
        t->no_events = v == 0;
    }
    return 1;
}

static int parse_state(const char *buf, size_t len, fstate_t *st)
{
    static char line[MAX_LINE];
    char *tok[MAX_TOK];
    size_t pos = 0;
    int lineno = 0;
    fdev_t *d = NULL;

    memset(st, 0, offsetof(fstate_t, devs));
    st->ndev = 0;

    while (pos < len) {
        size_t start = pos;
        while (pos < len && buf[pos] != '\n')
            pos++;
        size_t n = pos - start;
        pos++; /* skip '\n' */
        lineno++;
        if (n >= MAX_LINE)
            return lineno;
        memcpy(line, buf + start, n);
        line[n] = 0;
        char *hash = strchr(line, '#');
        if (hash)
            *hash = 0;
        for (char *p = line; *p; p++)
            if (*p == '\t' || *p == '\r' || *p == '\v' || *p == '\f')
                *p = ' ';
        /* trim */
        char *s = line;
        while (*s == ' ')
            s++;
        size_t sl = strlen(s);
        while (sl && s[sl - 1] == ' ')
            s[--sl] = 0;
        if (!*s)
            continue;
        /* key and the raw rest (for string values) */
        char *key = s;
        char *rest = s;
        while (*rest && *rest != ' ')
            rest++;
        if (*rest) {
            *rest++ = 0;
            while (*rest == ' ')
                rest++;
        }
        /* tokenise a copy of the rest for numeric values */
        static char rbuf[MAX_LINE];
        strcpy(rbuf, rest);
        int nt = 0;
        for (char *p = strtok(rbuf, " "); p; p = strtok(NULL, " ")) {
            if (nt >= MAX_TOK)
                return lineno;
            tok[nt++] = p;
        }

#define NEED(cond) do { if (!(cond)) return lineno; } while (0)
#define DEV() NEED(d != NULL)
#define U32(field, bit) do { DEV(); NEED(nt == 1 && !parse_u32(tok[0], &d->field)); d->has |= 1ull << (bit); } while (0)
#define U64(field, bit) do { DEV(); NEED(nt == 1 && !parse_u64(tok[0], &d->field)); d->has |= 1ull << (bit); } while (0)

        if (!strcmp(key, "driver_version")) {
            NEED(!copy_str(st->driver, sizeof st->driver, rest));
            st->has_driver = 1;
        } else if (!strcmp(key, "nvml_version")) {
            NEED(!copy_str(st->nvml, sizeof st->nvml, rest));
            st->has_nvml = 1;
        } else if (!strcmp(key, "cuda_version")) {
            NEED(nt == 1 && !parse_i32(tok[0], &st->cuda));
            st->has_cuda = 1;
        } else if (!strcmp(key, "init_error")) {
            NEED(nt == 1 && !parse_i32(tok[0], &st->init_error));
        } else if (!strcmp(key, "device")) {
            NEED(nt == 0 && st->ndev < MAX_GPUS);
            d = &st->devs[st->ndev++];
            memset(d, 0, offsetof(fdev_t, migs));
        } else if (!strcmp(key, "name")) {
            DEV(); NEED(!copy_str(d->name, sizeof d->name, rest)); d->has |= 1ull << F_NAME;
        } else if (!strcmp(key, "uuid")) {
            DEV(); NEED(!copy_str(d->uuid, sizeof d->uuid, rest)); d->has |= 1ull << F_UUID;
        } else if (!strcmp(key, "serial")) {
            DEV(); NEED(!copy_str(d->serial, sizeof d->serial, rest)); d->has |= 1ull << F_SERIAL;
        } else if (!strcmp(key, "pci_bus_id")) {
            DEV();
            NEED(nt == 1 && !parse_busid(tok[0], &d->domain, &d->bus, &d->dev, &d->func));
            NEED(d->bus <= 0xFF && d->dev <= 0x1F && d->func <= 7);
            snprintf(d->busid, sizeof d->busid, "%08X:%02X:%02X.%X", d->domain, d->bus, d->dev, d->func);
            snprintf(d->busid_legacy, sizeof d->busid_legacy, "%04X:%02X:%02X.%X", d->domain & 0xFFFF, d->bus, d->dev, d->func);
            d->has |= 1ull << F_PCI;
        } else if (!strcmp(key, "pci_device_id")) {
            DEV(); NEED(nt == 1 && !parse_u32(tok[0], &d->pci_device_id));
        } else if (!strcmp(key, "pci_subsystem_id")) {
            DEV(); NEED(nt == 1 && !parse_u32(tok[0], &d->pci_subsystem_id));
        } else if (!strcmp(key, "minor")) {
            U32(minor, F_MINOR);
        } else if (!strcmp(key, "architecture")) {
            U32(arch, F_ARCH);
        } else if (!strcmp(key, "brand")) {
            U32(brand, F_BRAND);
        } else if (!strcmp(key, "cuda_cc")) {
            DEV();
            NEED(nt == 2 && !parse_u32(tok[0], &d->cc_major) && !parse_u32(tok[1], &d->cc_minor));
            d->has |= 1ull << F_CC;
        } else if (!strcmp(key, "memory_total")) {
            U64(mem_total, F_MEM_TOTAL);
        } else if (!strcmp(key, "memory_used")) {
            DEV(); NEED(nt == 1 && !parse_u64(tok[0], &d->mem_used));
        } else if (!strcmp(key, "memory_reserved")) {
            DEV(); NEED(nt == 1 && !parse_u64(tok[0], &d->mem_reserved));
        } else if (!strcmp(key, "bar1_total")) {
            U64(bar1_total, F_BAR1);
        } else if (!strcmp(key, "bar1_used")) {
            DEV(); NEED(nt == 1 && !parse_u64(tok[0], &d->bar1_used));
        } else if (!strcmp(key, "ecc_errors")) {
            U64(ecc, F_ECC);
        } else if (!strcmp(key, "util_gpu")) {
            U32(util_gpu, F_UTIL_GPU);
        } else if (!strcmp(key, "util_memory")) {
            U32(util_mem, F_UTIL_MEM);
        } else if (!strcmp(key, "util_encoder")) {
            U32(util_enc, F_UTIL_ENC);
        } else if (!strcmp(key, "util_decoder")) {
            U32(util_dec, F_UTIL_DEC);
        } else if (!strcmp(key, "util_samples") || !strcmp(key, "util_memory_samples")) {
            int mem = key[5] == 'm';
            DEV();
            NEED(nt >= 1 && nt <= MAX_SAMPLES);
            for (int i = 0; i < nt; i++)
                NEED(!parse_u32(tok[i], mem ? &d->msamples[i] : &d->samples[i]));
            if (mem) {
                d->nmsamples = (unsigned)nt;
                d->has |= 1ull << F_UTIL_MEM_SAMPLES;
            } else {
                d->nsamples = (unsigned)nt;
                d->has |= 1ull << F_UTIL_SAMPLES;
            }
        } else if (!strcmp(key, "temperature")) {
            U32(temp, F_TEMP);
        } else if (!strcmp(key, "power_usage")) {
            U32(power_usage, F_POWER_USAGE);
        } else if (!strcmp(key, "power_limit")) {
            U32(power_limit, F_POWER_LIMIT);
        } else if (!strcmp(key, "power_default_limit")) {
            U32(power_default_limit, F_POWER_DEFAULT_LIMIT);
        } else if (!strcmp(key, "fan")) {
            U32(fan, F_FAN);
        } else if (!strcmp(key, "pstate")) {
            U32(pstate, F_PSTATE);
        } else if (!strcmp(key, "compute_mode")) {
            U32(compute_mode, F_COMPUTE_MODE);
        } else if (!strcmp(key, "persistence_mode")) {
            U32(persistence, F_PERSISTENCE);
        } else if (!strcmp(key, "display_active")) {
            U32(display_active, F_DISPLAY_ACTIVE);
        } else if (!strcmp(key, "display_mode")) {
            U32(display_mode, F_DISPLAY_MODE);
        } else if (!strcmp(key, "clock_sm")) {
            U32(clock_sm, F_CLOCK_SM);
        } else if (!strcmp(key, "clock_sm_max")) {
            U32(clock_sm_max, F_CLOCK_SM_MAX);
        } else if (!strcmp(key, "clock_mem")) {
            U32(clock_mem, F_CLOCK_MEM);
        } else if (!strcmp(key, "clock_mem_max")) {
            U32(clock_mem_max, F_CLOCK_MEM_MAX);
        } else if (!strcmp(key, "clock_graphics")) {
            U32(clock_gr, F_CLOCK_GR);
        } else if (!strcmp(key, "clock_graphics_max")) {
            U32(clock_gr_max, F_CLOCK_GR_MAX);
        } else if (!strcmp(key, "clock_video")) {
            U32(clock_video, F_CLOCK_VIDEO);
        } else if (!strcmp(key, "clock_video_max")) {
            U32(clock_video_max, F_CLOCK_VIDEO_MAX);
        } else if (!strcmp(key, "pcie_tx")) {
            U32(pcie_tx, F_PCIE_TX);
        } else if (!strcmp(key, "pcie_rx")) {
            U32(pcie_rx, F_PCIE_RX);
        } else if (!strcmp(key, "mig_mode")) {
            DEV();
            NEED(nt == 1 || nt == 2);
            NEED(!parse_u32(tok[0], &d->mig_mode));
            d->mig_pending = d->mig_mode;
            if (nt == 2)
                NEED(!parse_u32(tok[1], &d->mig_pending));
            d->has |= 1ull << F_MIG_MODE;
        } else if (!strcmp(key, "mig_max_count")) {
            U32(mig_max, F_MIG_MAX);
            NEED(d->mig_max <= MAX_MIGS);
        } else if (!strcmp(key, "mig")) {
            DEV();
            NEED(nt >= 3 && nt <= 6 && d->nmig < MAX_MIGS);
            fmig_t *m = &d->migs[d->nmig];
            memset(m, 0, sizeof *m);
            NEED(!copy_str(m->profile, sizeof m->profile, tok[0]));
            NEED(!copy_str(m->uuid, sizeof m->uuid, tok[1]));
            NEED(!parse_u64(tok[2], &m->mem_total));
            if (nt > 3)
                NEED(!parse_u64(tok[3], &m->mem_used));
            if (nt > 4)
                NEED(!parse_u32(tok[4], &m->gi));
            if (nt > 5)
                NEED(!parse_u32(tok[5], &m->ci));
            d->nmig++;
        } else if (!strcmp(key, "process") || !strcmp(key, "graphics_process")) {
            int g = key[0] == 'g';
            unsigned *cnt = g ? &d->ngproc : &d->nproc;
            DEV();
            NEED((nt == 2 || nt == 4) && *cnt < MAX_PROCS);
            fproc_t *p = g ? &d->gprocs[*cnt] : &d->procs[*cnt];
            NEED(!parse_u32(tok[0], &p->pid) && !parse_u64(tok[1], &p->mem));
            p->gi = p->ci = NVML_NO_ID;
            if (nt == 4)
                NEED(!parse_u32(tok[2], &p->gi) && !parse_u32(tok[3], &p->ci));
            (*cnt)++;
        } else if (!strcmp(key, "process_util")) {
            DEV();
            NEED((nt == 3 || nt == 5) && d->nputil < MAX_PROCS);
            fputil_t *u = &d->putil[d->nputil];
            memset(u, 0, sizeof *u);
            NEED(!parse_u32(tok[0], &u->pid) && !parse_u32(tok[1], &u->sm) && !parse_u32(tok[2], &u->mem));
            if (nt == 5)
                NEED(!parse_u32(tok[3], &u->enc) && !parse_u32(tok[4], &u->dec));
            d->nputil++;
        } else if (!strcmp(key, "numa_node")) {
            U32(numa_node, F_NUMA);
        } else if (!strcmp(key, "pcie_switch")) {
            U32(pcie_switch, F_SWITCH);
        } else if (!strcmp(key, "host_bridge")) {
            U32(host_bridge, F_BRIDGE);
        } else if (!strcmp(key, "cpu_affinity")) {
            /* a Linux CPU list: 0-3,8,10-11 */
            DEV();
            NEED(nt == 1);
            memset(d->cpus, 0, sizeof d->cpus);
            char *p = tok[0];
            while (*p) {
                unsigned lo, hi;
                char *end;
                NEED(*p >= '0' && *p <= '9');
                lo = (unsigned)strtoul(p, &end, 10);
                hi = lo;
                if (*end == '-') {
                    p = end + 1;
                    NEED(*p >= '0' && *p <= '9');
                    hi = (unsigned)strtoul(p, &end, 10);
                }
                NEED(lo <= hi && hi < 64 * MAX_CPU_WORDS);
                for (unsigned c = lo; c <= hi; c++)
                    d->cpus[c / 64] |= 1ull << (c % 64);
                if (*end == ',')
                    end++;
                else
                    NEED(*end == 0);
                p = end;
            }
            d->has |= 1ull << F_CPUS;
        } else if (!strcmp(key, "nvlink")) {
            /* nvlink <remote pci bus id> [links]: that many active links to the remote device */
            unsigned dom, bus, dv, fn, count = 1;
            DEV();
            NEED((nt == 1 || nt == 2) && !parse_busid(tok[0], &dom, &bus, &dv, &fn));
            if (nt == 2)
                NEED(!parse_u32(tok[1], &count) && count >= 1);
            NEED(d->nlink + count <= MAX_LINKS);
            for (unsigned k = 0; k < count; k++, d->nlink++) {
                d->link_dom[d->nlink] = dom;
                d->link_bus[d->nlink] = bus;
                d->link_dev[d->nlink] = dv;
                d->link_fn[d->nlink] = fn;
            }
        } else if (!strcmp(key, "topology")) {
            /* topology <peer index> <NVML level>: overrides the level derived from the keys above */
            DEV();
            NEED(nt == 2 && d->nlevel < MAX_GPUS);
            NEED(!parse_u32(tok[0], &d->level_peer[d->nlevel]) && !parse_u32(tok[1], &d->level_value[d->nlevel]));
            NEED(d->level_peer[d->nlevel] < MAX_GPUS);
            d->nlevel++;
        } else if (!strcmp(key, "error")) {
            int code;
            DEV();
            NEED(nt == 2 && !parse_i32(tok[1], &code));
            if (!strcmp(tok[0], "*")) {
                d->err_all = code;
            } else {
                NEED(d->nerr < MAX_ERRORS);
                NEED(!copy_str(d->errs[d->nerr].fn, sizeof d->errs[d->nerr].fn, tok[0]));
                d->errs[d->nerr].code = code;
                d->nerr++;
            }
        } else {
            int r = parse_tel(d, key, tok, nt);
            NEED(r >= 0);
        }
        /* unknown keys are ignored */
#undef NEED
#undef DEV
#undef U32
#undef U64
    }
    return 0;
}

/* ------------------------------------------------------------------------ */
/* state file reloading                                                     */
/* ------------------------------------------------------------------------ */

enum { LOAD_OK = 0, LOAD_NO_FILE = 1, LOAD_BAD = 2 };

static int read_fd(int fd, char *buf, size_t cap, size_t *out_len)
{
    size_t n = 0;
    for (;;) {
        if (n == cap)
            return -1; /* too large */
        ssize_t r = read(fd, buf + n, cap - n);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (r == 0)
            break;
        n += (size_t)r;
    }
    *out_len = n;
    return 0;
}

static long long st_mtime_ns(const struct stat *st)
{
    return (long long)st->st_mtim.tv_sec * 1000000000ll + st->st_mtim.tv_nsec;
}

static long long st_ctime_ns(const struct stat *st)
{
    return (long long)st->st_ctim.tv_sec * 1000000000ll + st->st_ctim.tv_nsec;
}

static int same_identity(const char *path, const struct stat *st)
{
    return g_cur && !strcmp(path, g_path) && st->st_dev == g_st_dev &&
           st->st_ino == g_st_ino && st->st_size == g_st_size &&
           st_mtime_ns(st) == g_st_mtime && st_ctime_ns(st) == g_st_ctime;
}

static void remember_identity(const char *path, const struct stat *st, long long t_open)
{
    snprintf(g_path, sizeof g_path, "%s", path);
    g_st_dev = st->st_dev;
    g_st_ino = st->st_ino;
    g_st_size = st->st_size;
    g_st_mtime = st_mtime_ns(st);
    g_st_ctime = st_ctime_ns(st);
    long long newest = g_st_mtime > g_st_ctime ? g_st_mtime : g_st_ctime;
    /* A later write within the timestamp granularity could leave every stat
     * field unchanged (inode reuse after rename on ext4 is possible), so while
     * the file is that fresh we also compare its content on each call. */
    g_racy = newest >= t_open - RACY_WINDOW_NS;
}

/* Make sure g_cur reflects the state file.  Called with g_mu held. */
static int refresh(void)
{
    const char *path = getenv("GPUSD_FAKE_NVML_STATE");
    struct stat st;
    if (!path || !*path || strlen(path) >= sizeof g_path)
        return g_cur ? LOAD_OK : LOAD_NO_FILE;
    if (stat(path, &st) != 0)
        return g_cur ? LOAD_OK : LOAD_NO_FILE;
    if (same_identity(path, &st) && !g_racy)
        return LOAD_OK;

    long long t_open = now_ns();
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return g_cur ? LOAD_OK : LOAD_NO_FILE;
    size_t len = 0;
    if (fstat(fd, &st) != 0 || read_fd(fd, g_raw_tmp, MAX_FILE, &len) != 0) {
        close(fd);
        return g_cur ? LOAD_OK : LOAD_BAD;
    }
    close(fd);

    if (same_identity(path, &st) && len == g_raw_len && !memcmp(g_raw_tmp, g_raw_cur, len)) {
        remember_identity(path, &st, t_open);
        return LOAD_OK;
    }

    fstate_t *next = (g_cur == &g_states[0]) ? &g_states[1] : &g_states[0];
    int bad_line = parse_state(g_raw_tmp, len, next);
    if (bad_line) {
        if (getenv("GPUSD_FAKE_NVML_DEBUG"))
            fprintf(stderr, "fake-nvml: %s:%d: malformed state file, keeping the previous state\n",
                    path, bad_line);
        return g_cur ? LOAD_OK : LOAD_BAD;
    }
    g_cur = next;
    char *t = g_raw_cur;
    g_raw_cur = g_raw_tmp;
    g_raw_tmp = t;
    g_raw_len = len;
    remember_identity(path, &st, t_open);
    return LOAD_OK;
}

/* ------------------------------------------------------------------------ */
/* call prologue / epilogue                                                 */
/* ------------------------------------------------------------------------ */

/* -- the driver's cost and the call counter ------------------------------
 * A real driver's call is an ioctl that costs tens of microseconds, and some calls (NVLink and
 * topology queries, process lists) cost far more; on this fake a call is nearly free, so a ratio
 * measured against a peer would reward making many calls.  GPUSD_FAKE_NVML_COST_US (per call) and
 * GPUSD_FAKE_NVML_SLOW_COST_US (the slow calls) make each call spin that long (CPU time, as a
 * driver's ioctl is).  GPUSD_FAKE_NVML_COUNTS names a directory where each process keeps a file
 * named by its pid: COUNT_SLOTS records of {char name[56]; uint64 count}, mapped shared, so a test
 * or benchmark reads the counts while the process runs and after it died (even by SIGKILL). */
#define COUNT_SLOTS 128
#define COUNT_NAME 56
typedef struct { char name[COUNT_NAME]; volatile uint64_t count; } cslot_t;
static cslot_t *g_counts;        /* this process's mapped file (NULL: not counting) */
static pid_t g_counts_pid;       /* the process that mapped it: a forked child maps its own */
static char g_counts_dir[3800];  /* the directory it is in: another one set later maps a new file */

static const char *const SLOW_CALLS[] = {
    "nvmlDeviceGetTopologyCommonAncestor", "nvmlDeviceGetTopologyNearestGpus", "nvmlDeviceGetP2PStatus", "nvmlDeviceGetNvLinkState",
    "nvmlDeviceGetNvLinkRemotePciInfo_v2", "nvmlDeviceGetNvLinkRemotePciInfo",
    "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses",
    "nvmlDeviceGetGraphicsRunningProcesses_v2", "nvmlDeviceGetGraphicsRunningProcesses_v3",
    "nvmlDeviceGetMPSComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses_v2",
    "nvmlDeviceGetMPSComputeRunningProcesses_v3", "nvmlDeviceGetProcessUtilization",
};

static int slow_call(const char *fn)
{
    for (size_t i = 0; i < sizeof SLOW_CALLS / sizeof SLOW_CALLS[0]; i++)
        if (!strcmp(SLOW_CALLS[i], fn))
            return 1;
    return 0;
}

static long cost_env(const char *name)
{
    const char *v = getenv(name);
    if (!v || !*v)
        return 0;
    char *end;
    long us = strtol(v, &end, 10);
    return (*end || us < 0 || us > 10000000) ? 0 : us;
}

static void counts_map(void)
{
    const char *dir = getenv("GPUSD_FAKE_NVML_COUNTS");
    pid_t pid = getpid();
    if (g_counts && g_counts_pid == pid && dir && !strcmp(dir, g_counts_dir))
        return;
    if (g_counts) { /* the parent's file (inherited across fork), or another directory's */
        munmap((void *)g_counts, sizeof(cslot_t) * COUNT_SLOTS);
        g_counts = NULL;
    }
    g_counts_pid = pid;
    if (!dir || !*dir || strlen(dir) >= sizeof g_counts_dir)
        return;
    strcpy(g_counts_dir, dir);
    char path[4096];
    snprintf(path, sizeof path, "%s/%ld", dir, (long)pid);
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0)
        return;
    if (ftruncate(fd, sizeof(cslot_t) * COUNT_SLOTS) == 0) {
        void *p = mmap(NULL, sizeof(cslot_t) * COUNT_SLOTS, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p != MAP_FAILED)
            g_counts = p;
    }
    close(fd);
}

/* The functions called so far in this process: their record in the counts file has the same
 * index.  Keyed by the name's address (a string literal: one per function), so a call costs a
 * short scan of pointers, not string compares. */
static struct { const char *fn; int slow; } g_called[COUNT_SLOTS];
static int g_ncalled;

/* Count one call of fn and spend its cost.  Called with g_mu held. */
static void account(const char *fn)
{
    int i = 0;
    while (i < g_ncalled && g_called[i].fn != fn)
        i++;
    if (i == g_ncalled && i < COUNT_SLOTS) {
        g_called[i].fn = fn;
        g_called[i].slow = slow_call(fn);
        g_ncalled++;
    }
    int slow = i < COUNT_SLOTS ? g_called[i].slow : 0;
    long us = cost_env(slow ? "GPUSD_FAKE_NVML_SLOW_COST_US" : "GPUSD_FAKE_NVML_COST_US");
    if (i < COUNT_SLOTS && getenv("GPUSD_FAKE_NVML_COUNTS")) {
        counts_map();
        if (g_counts) {
            if (!g_counts[i].name[0])
                strncpy(g_counts[i].name, fn, COUNT_NAME - 1);
            g_counts[i].count++;
        }
    }
    if (us > 0) {
        long long until = mono_ns() + us * 1000ll;
        while (mono_ns() < until)
            ;
    }
}

static nvmlReturn_t enter(void)
{
    if (g_refcount <= 0)
        return NVML_ERROR_UNINITIALIZED;
    refresh();
    if (!g_cur)
        return NVML_ERROR_UNINITIALIZED;
    return NVML_SUCCESS;
}

static int injected(const fdev_t *d, const char *fn, const char *family)
{
    if (d->err_all)
        return d->err_all;
    for (unsigned i = 0; i < d->nerr; i++) {
        if (!strcmp(d->errs[i].fn, fn) || (family && !strcmp(d->errs[i].fn, family)))
            return d->errs[i].code ? d->errs[i].code : NVML_SUCCESS;
    }
    return NVML_SUCCESS;
}

/* classify a handle: 1 physical, 2 MIG, 0 invalid */
static int handle_kind(const void *h, unsigned *gi, unsigned *mi)
{
    uintptr_t p = (uintptr_t)h;
    uintptr_t b0 = (uintptr_t)g_hdev, e0 = b0 + sizeof g_hdev;
    uintptr_t b1 = (uintptr_t)g_hmig, e1 = b1 + sizeof g_hmig;
    if (p >= b0 && p < e0 && (p - b0) % sizeof(hdev_t) == 0) {
        *gi = (unsigned)((p - b0) / sizeof(hdev_t));
        *mi = 0;
        return 1;
    }
    if (p >= b1 && p < e1 && (p - b1) % sizeof(hmig_t) == 0) {
        unsigned k = (unsigned)((p - b1) / sizeof(hmig_t));
        *gi = k / MAX_MIGS;
        *mi = k % MAX_MIGS;
        return 2;
    }
    return 0;
}

/* Resolve a device handle (with g_mu held and NVML initialised). */
static nvmlReturn_t resolve(void *h, const char *fn, const char *family, int mig_ok,
                            fdev_t **dp, fmig_t **mp)
{
    unsigned gi, mi;
    int kind = handle_kind(h, &gi, &mi);
    *dp = NULL;
    *mp = NULL;
    if (!kind)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (gi >= g_cur->ndev)
        return NVML_ERROR_GPU_IS_LOST;
    fdev_t *d = &g_cur->devs[gi];
    if (kind == 1) {
        int e = injected(d, fn, family);
        if (e)
            return e;
        *dp = d;
        return NVML_SUCCESS;
    }
    if (mi >= d->nmig || !(HAS(d, F_MIG_MODE) && d->mig_mode == 1))
        return NVML_ERROR_GPU_IS_LOST;
    if (!mig_ok)
        return NVML_ERROR_NOT_SUPPORTED;
    *dp = d;
    *mp = &d->migs[mi];
    return NVML_SUCCESS;
}

#define BEGIN() BEGIN_NAMED(__func__)
#define BEGIN_NAMED(name)                         \
    nvmlReturn_t rc;                              \
    pthread_mutex_lock(&g_mu);                    \
    account(name);                                \
    rc = enter();                                 \
    if (rc != NVML_SUCCESS)                       \
        goto out;

#define BEGIN_DEV(h, fn, family, mig_ok)                          \
    fdev_t *d = NULL;                                             \
    fmig_t *m = NULL;                                             \
    BEGIN_NAMED(fn);                                              \
    rc = resolve((void *)(h), (fn), (family), (mig_ok), &d, &m);  \
    if (rc != NVML_SUCCESS)                                       \
        goto out;                                                 \
    (void)m;

#define RET(x) do { rc = (x); goto out; } while (0)
#define REQUIRE(f) do { if (!HAS(d, f)) RET(NVML_ERROR_NOT_SUPPORTED); } while (0)
#define NONNULL(p) do { if (!(p)) RET(NVML_ERROR_INVALID_ARGUMENT); } while (0)
#define END()                          \
    out:                               \
    pthread_mutex_unlock(&g_mu);       \
    return rc;

typedef struct nvmlDevice_st *nvmlDevice_t;

/* ------------------------------------------------------------------------ */
/* init / shutdown / errors                                                 */
/* ------------------------------------------------------------------------ */

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    nvmlReturn_t rc = NVML_SUCCESS;
    pthread_mutex_lock(&g_mu);
    account(__func__);
    init_handles();
    int r = refresh();
    if (r == LOAD_NO_FILE)
        rc = NVML_ERROR_DRIVER_NOT_LOADED;
    else if (r == LOAD_BAD || !g_cur)
        rc = NVML_ERROR_UNKNOWN;
    else if (g_cur->init_error)
        rc = g_cur->init_error;
    else
        g_refcount++;
    pthread_mutex_unlock(&g_mu);
    return rc;
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
EXPORT nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

EXPORT nvmlReturn_t nvmlShutdown(void)
{
    nvmlReturn_t rc = NVML_SUCCESS;
    pthread_mutex_lock(&g_mu);
    account(__func__);
    if (g_refcount <= 0)
        rc = NVML_ERROR_UNINITIALIZED;
    else
        g_refcount--;
    pthread_mutex_unlock(&g_mu);
    return rc;
}

EXPORT const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_VGPU_ECC_NOT_SUPPORTED: return "The requested vgpu operation is not available on target device, because ECC is enabled";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient resources";
    case NVML_ERROR_FREQ_NOT_SUPPORTED: return "Frequency not supported";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    case NVML_ERROR_DEPRECATED: return "Deprecated";
    case NVML_ERROR_NOT_READY: return "Not ready";
    case NVML_ERROR_GPU_NOT_FOUND: return "GPU not found";
    case NVML_ERROR_INVALID_STATE: return "Invalid state";
    case NVML_ERROR_RESET_TYPE_NOT_SUPPORTED: return "Reset type not supported";
    default: return "Unknown Error";
    }
}

/* ------------------------------------------------------------------------ */
/* system queries                                                           */
/* ------------------------------------------------------------------------ */

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    BEGIN();
    if (!g_cur->has_driver)
        RET(NVML_ERROR_NOT_SUPPORTED);
    rc = put_str(version, length, g_cur->driver);
    END();
}

EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    BEGIN();
    if (!g_cur->has_nvml)
        RET(NVML_ERROR_NOT_SUPPORTED);
    rc = put_str(version, length, g_cur->nvml);
    END();
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v)
{
    BEGIN();
    NONNULL(v);
    if (!g_cur->has_cuda)
        RET(NVML_ERROR_NOT_SUPPORTED);
    *v = g_cur->cuda;
    END();
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) { return nvmlSystemGetCudaDriverVersion(v); }

EXPORT nvmlReturn_t nvmlSystemGetProcessName(unsigned int pid, char *name, unsigned int length)
{
    char path[64], buf[256];
    BEGIN();
    NONNULL(name);
    if (length == 0)
        RET(NVML_ERROR_INVALID_ARGUMENT);
    snprintf(path, sizeof path, "/proc/%u/comm", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        RET(NVML_ERROR_NOT_FOUND);
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        RET(NVML_ERROR_NOT_FOUND);
    buf[n] = 0;
    if (n && buf[n - 1] == '\n')
        buf[n - 1] = 0;
    /* truncates like the real NVML */
    snprintf(name, length, "%s", buf);
    END();
}

/* ------------------------------------------------------------------------ */
/* enumeration                                                              */
/* ------------------------------------------------------------------------ */

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    BEGIN();
    NONNULL(count);
    *count = g_cur->ndev;
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

/* `error nvmlDeviceGetHandleBy* <code>` lines apply to handle lookups that
 * resolve to that device (`error *` does not). */
static nvmlReturn_t lookup_result(unsigned idx, const char *fn, const char *family, nvmlDevice_t *out)
{
    fdev_t *d = &g_cur->devs[idx];
    for (unsigned i = 0; i < d->nerr; i++)
        if (!strcmp(d->errs[i].fn, fn) || !strcmp(d->errs[i].fn, family))
            if (d->errs[i].code)
                return d->errs[i].code;
    *out = (nvmlDevice_t)(void *)&g_hdev[idx];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    BEGIN();
    NONNULL(device);
    if (index >= g_cur->ndev)
        RET(NVML_ERROR_INVALID_ARGUMENT);
    rc = lookup_result(index, "nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByIndex", device);
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    BEGIN();
    NONNULL(uuid);
    NONNULL(device);
    for (unsigned i = 0; i < g_cur->ndev; i++) {
        fdev_t *d = &g_cur->devs[i];
        if (HAS(d, F_UUID) && !strcmp(d->uuid, uuid))
            RET(lookup_result(i, "nvmlDeviceGetHandleByUUID", "nvmlDeviceGetHandleByUUID", device));
        if (HAS(d, F_MIG_MODE) && d->mig_mode == 1) {
            for (unsigned j = 0; j < d->nmig; j++) {
                if (!strcmp(d->migs[j].uuid, uuid)) {
                    *device = (nvmlDevice_t)(void *)&g_hmig[i][j];
                    RET(NVML_SUCCESS);
                }
            }
        }
    }
    rc = NVML_ERROR_NOT_FOUND;
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleBySerial(const char *serial, nvmlDevice_t *device)
{
    BEGIN();
    NONNULL(serial);
    NONNULL(device);
    for (unsigned i = 0; i < g_cur->ndev; i++) {
        fdev_t *d = &g_cur->devs[i];
        if (HAS(d, F_SERIAL) && !strcmp(d->serial, serial))
            RET(lookup_result(i, "nvmlDeviceGetHandleBySerial", "nvmlDeviceGetHandleBySerial", device));
    }
    rc = NVML_ERROR_NOT_FOUND;
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *busid, nvmlDevice_t *device)
{
    unsigned dom, bus, dv, fn;
    BEGIN();
    NONNULL(busid);
    NONNULL(device);
    if (parse_busid(busid, &dom, &bus, &dv, &fn) != 0)
        RET(NVML_ERROR_INVALID_ARGUMENT);
    for (unsigned i = 0; i < g_cur->ndev; i++) {
        fdev_t *d = &g_cur->devs[i];
        if (HAS(d, F_PCI) && d->domain == dom && d->bus == bus && d->dev == dv && d->func == fn)
            RET(lookup_result(i, "nvmlDeviceGetHandleByPciBusId_v2", "nvmlDeviceGetHandleByPciBusId", device));
    }
    rc = NVML_ERROR_NOT_FOUND;
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *busid, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByPciBusId_v2(busid, device);
}

EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t h, unsigned int *index)
{
    BEGIN_DEV(h, "nvmlDeviceGetIndex", NULL, 0);
    NONNULL(index);
    *index = (unsigned)(d - g_cur->devs);
    END();
}

/* ------------------------------------------------------------------------ */
/* identity                                                                 */
/* ------------------------------------------------------------------------ */

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t h, char *name, unsigned int length)
{
    BEGIN_DEV(h, "nvmlDeviceGetName", NULL, 1);
    REQUIRE(F_NAME);
    if (m) {
        char buf[160];
        snprintf(buf, sizeof buf, "%s MIG %s", d->name, m->profile);
        rc = put_str(name, length, buf);
    } else {
        rc = put_str(name, length, d->name);
    }
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t h, char *uuid, unsigned int length)
{
    BEGIN_DEV(h, "nvmlDeviceGetUUID", NULL, 1);
    if (m)
        RET(put_str(uuid, length, m->uuid));
    REQUIRE(F_UUID);
    rc = put_str(uuid, length, d->uuid);
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t h, char *serial, unsigned int length)
{
    BEGIN_DEV(h, "nvmlDeviceGetSerial", NULL, 0);
    REQUIRE(F_SERIAL);
    rc = put_str(serial, length, d->serial);
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t h, unsigned int *minor)
{
    BEGIN_DEV(h, "nvmlDeviceGetMinorNumber", NULL, 0);
    NONNULL(minor);
    REQUIRE(F_MINOR);
    *minor = d->minor;
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t h, unsigned int *brand)
{
    BEGIN_DEV(h, "nvmlDeviceGetBrand", NULL, 0);
    NONNULL(brand);
    REQUIRE(F_BRAND);
    *brand = d->brand;
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t h, unsigned int *arch)
{
    BEGIN_DEV(h, "nvmlDeviceGetArchitecture", NULL, 0);
    NONNULL(arch);
    REQUIRE(F_ARCH);
    *arch = d->arch;
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t h, int *major, int *minor)
{
    BEGIN_DEV(h, "nvmlDeviceGetCudaComputeCapability", NULL, 1);
    NONNULL(major);
    NONNULL(minor);
    REQUIRE(F_CC);
    *major = (int)d->cc_major;
    *minor = (int)d->cc_minor;
    END();
}

static unsigned pci_dev_id(const fdev_t *d) { return d->pci_device_id ? d->pci_device_id : 0x20B210DEu; }
static unsigned pci_sub_id(const fdev_t *d) { return d->pci_subsystem_id ? d->pci_subsystem_id : 0x147F10DEu; }

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t h, nvmlPciInfo_t *pci)
{
    BEGIN_DEV(h, "nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetPciInfo", 0);
    NONNULL(pci);
    REQUIRE(F_PCI);
    memset(pci, 0, sizeof *pci);
    memcpy(pci->busIdLegacy, d->busid_legacy, sizeof pci->busIdLegacy);
    memcpy(pci->busId, d->busid, sizeof pci->busId);
    pci->domain = d->domain;
    pci->bus = d->bus;
    pci->device = d->dev;
    pci->pciDeviceId = pci_dev_id(d);
    pci->pciSubSystemId = pci_sub_id(d);
    END();
}

static nvmlReturn_t pci_info_legacy(nvmlDevice_t h, nvmlPciInfo_v2_t *pci, const char *fn)
{
    BEGIN_DEV(h, fn, "nvmlDeviceGetPciInfo", 0);
    NONNULL(pci);
    REQUIRE(F_PCI);
    memset(pci, 0, sizeof *pci);
    memcpy(pci->busId, d->busid_legacy, sizeof pci->busId);
    pci->domain = d->domain;
    pci->bus = d->bus;
    pci->device = d->dev;
    pci->pciDeviceId = pci_dev_id(d);
    pci->pciSubSystemId = pci_sub_id(d);
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t h, nvmlPciInfo_v2_t *pci)
{
    return pci_info_legacy(h, pci, "nvmlDeviceGetPciInfo_v2");
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t h, nvmlPciInfo_v2_t *pci)
{
    return pci_info_legacy(h, pci, "nvmlDeviceGetPciInfo");
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfoExt(nvmlDevice_t h, nvmlPciInfoExt_t *pci)
{
    BEGIN_DEV(h, "nvmlDeviceGetPciInfoExt", "nvmlDeviceGetPciInfo", 0);
    NONNULL(pci);
    if (pci->version != nvmlPciInfoExt_v1)
        RET(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    REQUIRE(F_PCI);
    memset(pci, 0, sizeof *pci);
    pci->version = nvmlPciInfoExt_v1;
    memcpy(pci->busId, d->busid, sizeof pci->busId);
    pci->domain = d->domain;
    pci->bus = d->bus;
    pci->device = d->dev;
    pci->pciDeviceId = pci_dev_id(d);
    pci->pciSubSystemId = pci_sub_id(d);
    pci->baseClass = 3; /* display controller */
    pci->subClass = 2;  /* 3D controller */
    END();
}

/* ------------------------------------------------------------------------ */
/* memory                                                                   */
/* ------------------------------------------------------------------------ */

static void mem_numbers(const fdev_t *d, const fmig_t *m, ull *total, ull *reserved, ull *used, ull *free_)
{
    ull t, r, u;
    if (m) {
        t = m->mem_total;
        r = 0;
        u = m->mem_used;
    } else {
        t = d->mem_total;
        r = d->mem_reserved;
        u = d->mem_used;
    }
    *total = t;
    *reserved = r;
    *used = u;
    *free_ = (u + r >= t) ? 0 : t - u - r;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t h, nvmlMemory_t *mem)
{
    ull t, r, u, f;
    BEGIN_DEV(h, "nvmlDeviceGetMemoryInfo", NULL, 1);
    NONNULL(mem);
    if (!m)
        REQUIRE(F_MEM_TOTAL);
    mem_numbers(d, m, &t, &r, &u, &f);
    mem->total = t;
    mem->free = f;
    mem->used = t - f; /* v1 counts reserved memory as used */
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t h, nvmlMemory_v2_t *mem)
{
    ull t, r, u, f;
    BEGIN_DEV(h, "nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetMemoryInfo", 1);
    NONNULL(mem);
    if (mem->version != nvmlMemory_v2)
        RET(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    if (!m)
        REQUIRE(F_MEM_TOTAL);
    mem_numbers(d, m, &t, &r, &u, &f);
    mem->total = t;
    mem->reserved = r;
    mem->free = f;
    mem->used = u;
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetBAR1MemoryInfo(nvmlDevice_t h, nvmlBAR1Memory_t *bar1)
{
    BEGIN_DEV(h, "nvmlDeviceGetBAR1MemoryInfo", NULL, 1);
    NONNULL(bar1);
    if (m) {
        /* MIG devices always answer (nvitop's MIG row needs it): the parent's
         * BAR1 size, or the MIG memory size when the parent has none. */
        bar1->bar1Total = HAS(d, F_BAR1) ? d->bar1_total : m->mem_total;
        bar1->bar1Used = 0;
        bar1->bar1Free = bar1->bar1Total;
        RET(NVML_SUCCESS);
    }
    REQUIRE(F_BAR1);
    bar1->bar1Total = d->bar1_total;
    bar1->bar1Used = d->bar1_used > d->bar1_total ? d->bar1_total : d->bar1_used;
    bar1->bar1Free = d->bar1_total - bar1->bar1Used;
    END();
}

/* ------------------------------------------------------------------------ */
/* utilisation and samples                                                  */
/* ------------------------------------------------------------------------ */

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t h, nvmlUtilization_t *util)
{
    BEGIN_DEV(h, "nvmlDeviceGetUtilizationRates", NULL, 0);
    NONNULL(util);
    if (!HAS(d, F_UTIL_GPU) && !HAS(d, F_UTIL_MEM))
        RET(NVML_ERROR_NOT_SUPPORTED);
    util->gpu = HAS(d, F_UTIL_GPU) ? d->util_gpu : 0;
    util->memory = HAS(d, F_UTIL_MEM) ? d->util_mem : 0;
    END();
}

static nvmlReturn_t enc_dec(nvmlDevice_t h, unsigned *util, unsigned *period, int dec)
{
    const char *fn = dec ? "nvmlDeviceGetDecoderUtilization" : "nvmlDeviceGetEncoderUtilization";
    BEGIN_DEV(h, fn, NULL, 0);
    NONNULL(util);
    NONNULL(period);
    REQUIRE(dec ? F_UTIL_DEC : F_UTIL_ENC);
    *util = dec ? d->util_dec : d->util_enc;
    *period = 167000;
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetEncoderUtilization(nvmlDevice_t h, unsigned *util, unsigned *period)
{
    return enc_dec(h, util, period, 0);
}

EXPORT nvmlReturn_t nvmlDeviceGetDecoderUtilization(nvmlDevice_t h, unsigned *util, unsigned *period)
{
    return enc_dec(h, util, period, 1);
}

/* Newest timestamp of the sample grid for (device, type).  A fetch that
 * follows a size query within 100 ms reuses the grid of that query, so the
 * usual two-call pattern cannot see the sample count change in between. */
static ull grid_last(unsigned di, unsigned type, int sizing)
{
    ull now = now_us();
    ull last = now - now % SAMPLE_PERIOD_US;
    if (type >= 16)
        return last;
    if (!sizing && g_grid_wall[di][type] && now - g_grid_wall[di][type] < 100000ull)
        last = g_grid_last[di][type];
    g_grid_last[di][type] = last;
    g_grid_wall[di][type] = sizing ? now : 0;
    return last;
}

EXPORT nvmlReturn_t nvmlDeviceGetSamples(nvmlDevice_t h, unsigned int type, ull lastSeen,
                                         unsigned int *valType, unsigned int *count, nvmlSample_t *samples)
{
    const unsigned *vals = NULL;
    unsigned nvals = 0, constant = 0;
    BEGIN_DEV(h, "nvmlDeviceGetSamples", NULL, 0);
    NONNULL(valType);
    NONNULL(count);
    switch (type) {
    case 0: /* NVML_TOTAL_POWER_SAMPLES, mW */
        REQUIRE(F_POWER_USAGE);
        constant = d->power_usage;
        break;
    case 1: /* NVML_GPU_UTILIZATION_SAMPLES */
        if (HAS(d, F_UTIL_SAMPLES)) {
            vals = d->samples;
            nvals = d->nsamples;
        } else {
            REQUIRE(F_UTIL_GPU);
            constant = d->util_gpu;
        }
        break;
    case 2: /* NVML_MEMORY_UTILIZATION_SAMPLES */
        if (HAS(d, F_UTIL_MEM_SAMPLES)) {
            vals = d->msamples;
            nvals = d->nmsamples;
        } else {
            REQUIRE(F_UTIL_MEM);
            constant = d->util_mem;
        }
        break;
    case 3: REQUIRE(F_UTIL_ENC); constant = d->util_enc; break;
    case 4: REQUIRE(F_UTIL_DEC); constant = d->util_dec; break;
    case 5: REQUIRE(F_CLOCK_SM); constant = d->clock_sm; break;
    case 6: REQUIRE(F_CLOCK_MEM); constant = d->clock_mem; break;
    default:
        RET(NVML_ERROR_NOT_SUPPORTED);
    }
    if (!vals)
        nvals = (unsigned)((SYNTH_WINDOW_US + SAMPLE_PERIOD_US - 1) / SAMPLE_PERIOD_US); /* 12 */
    unsigned di = (unsigned)(d - g_cur->devs);
    ull last = grid_last(di, type, samples == NULL);
    /* sample i (oldest first) has timestamp last - (nvals-1-i)*period */
    unsigned first = 0;
    while (first < nvals && last - (ull)(nvals - 1 - first) * SAMPLE_PERIOD_US <= lastSeen)
        first++;
    unsigned n = nvals - first;
    *valType = NVML_VALUE_TYPE_UNSIGNED_INT;
    if (n == 0) {
        *count = 0;
        RET(NVML_ERROR_NOT_FOUND);
    }
    if (!samples) {
        *count = n;
        RET(NVML_SUCCESS);
    }
    if (*count < n) {
        *count = n;
        RET(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (unsigned i = 0; i < n; i++) {
        unsigned k = first + i;
        samples[i].timeStamp = last - (ull)(nvals - 1 - k) * SAMPLE_PERIOD_US;
        samples[i].sampleValue.ullVal = 0;
        samples[i].sampleValue.uiVal = vals ? vals[k] : constant;
    }
    *count = n;
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t h, nvmlProcessUtilizationSample_t *util,
                                                    unsigned int *count, ull lastSeen)
{
    BEGIN_DEV(h, "nvmlDeviceGetProcessUtilization", NULL, 0);
    NONNULL(count);
    unsigned di = (unsigned)(d - g_cur->devs);
    ull last = grid_last(di, 15, util == NULL);
    if (d->nputil == 0 || last <= lastSeen) {
        *count = 0;
        RET(NVML_ERROR_NOT_FOUND);
    }
    if (!util || *count < d->nputil) {
        *count = d->nputil;
        RET(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (unsigned i = 0; i < d->nputil; i++) {
        util[i].pid = d->putil[i].pid;
        util[i].timeStamp = last;
        util[i].smUtil = d->putil[i].sm;
        util[i].memUtil = d->putil[i].mem;
        util[i].encUtil = d->putil[i].enc;
        util[i].decUtil = d->putil[i].dec;
    }
    *count = d->nputil;
    END();
}

/* ------------------------------------------------------------------------ */
/* thermals, power, fans, clocks, modes                                     */
/* ------------------------------------------------------------------------ */

EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t h, unsigned int sensor, unsigned int *temp)
{
    BEGIN_DEV(h, "nvmlDeviceGetTemperature", NULL, 0);
    NONNULL(temp);
    if (sensor != 0)
        RET(NVML_ERROR_NOT_SUPPORTED);
    REQUIRE(F_TEMP);
    *temp = d->temp;
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t h, nvmlTemperature_t *temp)
{
    BEGIN_DEV(h, "nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature", 0);
    NONNULL(temp);
    if (temp->version != nvmlTemperature_v1)
        RET(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    if (temp->sensorType != 0)
        RET(NVML_ERROR_NOT_SUPPORTED);
    REQUIRE(F_TEMP);
    temp->temperature = (int)d->temp;
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t h, unsigned int *power)
{
    BEGIN_DEV(h, "nvmlDeviceGetPowerUsage", NULL, 0);
    NONNULL(power);
    REQUIRE(F_POWER_USAGE);
    *power = d->power_usage;
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t h, unsigned int *limit)
{
    BEGIN_DEV(h, "nvmlDeviceGetEnforcedPowerLimit", NULL, 0);
    NONNULL(limit);
    REQUIRE(F_POWER_LIMIT);
    *limit = d->power_limit;
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t h, unsigned int *limit)
{
    BEGIN_DEV(h, "nvmlDeviceGetPowerManagementLimit", NULL, 0);
    NONNULL(limit);
    REQUIRE(F_POWER_LIMIT);
    *limit = d->power_limit;
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetPowerManagementDefaultLimit(nvmlDevice_t h, unsigned int *limit)
{
    BEGIN_DEV(h, "nvmlDeviceGetPowerManagementDefaultLimit", NULL, 0);
    NONNULL(limit);
    if (HAS(d, F_POWER_DEFAULT_LIMIT))
        *limit = d->power_default_limit;
    else if (HAS(d, F_POWER_LIMIT))
        *limit = d->power_limit;
    else
        RET(NVML_ERROR_NOT_SUPPORTED);
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetFanSpeed(nvmlDevice_t h, unsigned int *speed)
{
    BEGIN_DEV(h, "nvmlDeviceGetFanSpeed", NULL, 0);
    NONNULL(speed);
    REQUIRE(F_FAN);
    *speed = d->fan;
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetFanSpeed_v2(nvmlDevice_t h, unsigned int fan, unsigned int *speed)
{
    BEGIN_DEV(h, "nvmlDeviceGetFanSpeed_v2", "nvmlDeviceGetFanSpeed", 0);
    NONNULL(speed);
    REQUIRE(F_FAN);
    if (fan != 0)
        RET(NVML_ERROR_INVALID_ARGUMENT);
    *speed = d->fan;
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetNumFans(nvmlDevice_t h, unsigned int *num)
{
    BEGIN_DEV(h, "nvmlDeviceGetNumFans", NULL, 0);
    NONNULL(num);
    REQUIRE(F_FAN);
    *num = 1;
    END();
}

#define SIMPLE_U32(fname, field, bit)                              \
    EXPORT nvmlReturn_t fname(nvmlDevice_t h, unsigned int *out)   \
    {                                                              \
        BEGIN_DEV(h, #fname, NULL, 0);                             \
        NONNULL(out);                                              \
        REQUIRE(bit);                                              \
        *out = d->field;                                           \
        END();                                                     \
    }

SIMPLE_U32(nvmlDeviceGetPerformanceState, pstate, F_PSTATE)
SIMPLE_U32(nvmlDeviceGetComputeMode, compute_mode, F_COMPUTE_MODE)
SIMPLE_U32(nvmlDeviceGetPersistenceMode, persistence, F_PERSISTENCE)
SIMPLE_U32(nvmlDeviceGetDisplayActive, display_active, F_DISPLAY_ACTIVE)

EXPORT nvmlReturn_t nvmlDeviceGetPowerState(nvmlDevice_t h, unsigned int *out)
{
    BEGIN_DEV(h, "nvmlDeviceGetPowerState", "nvmlDeviceGetPerformanceState", 0);
    NONNULL(out);
    REQUIRE(F_PSTATE);
    *out = d->pstate;
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetDisplayMode(nvmlDevice_t h, unsigned int *out)
{
    BEGIN_DEV(h, "nvmlDeviceGetDisplayMode", NULL, 0);
    NONNULL(out);
    if (HAS(d, F_DISPLAY_MODE))
        *out = d->display_mode;
    else if (HAS(d, F_DISPLAY_ACTIVE))
        *out = d->display_active;
    else
        RET(NVML_ERROR_NOT_SUPPORTED);
    END();
}

/* clock types: 0 graphics, 1 SM, 2 memory, 3 video */
static nvmlReturn_t clock_value(const fdev_t *d, unsigned type, int max, unsigned *out)
{
    switch (type) {
    case 0:
        if (HAS(d, max ? F_CLOCK_GR_MAX : F_CLOCK_GR)) {
            *out = max ? d->clock_gr_max : d->clock_gr;
            return NVML_SUCCESS;
        }
        /* fall back to the SM clock */
        /* fall through */
    case 1:
        if (!HAS(d, max ? F_CLOCK_SM_MAX : F_CLOCK_SM))
            return NVML_ERROR_NOT_SUPPORTED;
        *out = max ? d->clock_sm_max : d->clock_sm;
        return NVML_SUCCESS;
    case 2:
        if (!HAS(d, max ? F_CLOCK_MEM_MAX : F_CLOCK_MEM))
            return NVML_ERROR_NOT_SUPPORTED;
        *out = max ? d->clock_mem_max : d->clock_mem;
        return NVML_SUCCESS;
    case 3:
        if (!HAS(d, max ? F_CLOCK_VIDEO_MAX : F_CLOCK_VIDEO))
            return NVML_ERROR_NOT_SUPPORTED;
        *out = max ? d->clock_video_max : d->clock_video;
        return NVML_SUCCESS;
    default:
        return NVML_ERROR_INVALID_ARGUMENT;
    }
}

EXPORT nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t h, unsigned int type, unsigned int *clock)
{
    BEGIN_DEV(h, "nvmlDeviceGetClockInfo", NULL, 0);
    NONNULL(clock);
    rc = clock_value(d, type, 0, clock);
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t h, unsigned int type, unsigned int *clock)
{
    BEGIN_DEV(h, "nvmlDeviceGetMaxClockInfo", NULL, 0);
    NONNULL(clock);
    rc = clock_value(d, type, 1, clock);
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t h, unsigned int counter, unsigned int *value)
{
    BEGIN_DEV(h, "nvmlDeviceGetPcieThroughput", NULL, 0);
    NONNULL(value);
    if (counter == 0) {
        REQUIRE(F_PCIE_TX);
        *value = d->pcie_tx;
    } else if (counter == 1) {
        REQUIRE(F_PCIE_RX);
        *value = d->pcie_rx;
    } else {
        RET(NVML_ERROR_INVALID_ARGUMENT);
    }
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t h, unsigned int errorType,
                                                unsigned int counterType, ull *count)
{
    (void)errorType;
    (void)counterType;
    BEGIN_DEV(h, "nvmlDeviceGetTotalEccErrors", NULL, 0);
    NONNULL(count);
    REQUIRE(F_ECC);
    *count = d->ecc;
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t h, int count, nvmlFieldValue_t *values)
{
    BEGIN_DEV(h, "nvmlDeviceGetFieldValues", NULL, 0);
    NONNULL(values);
    if (count <= 0)
        RET(NVML_ERROR_INVALID_ARGUMENT);
    long long t = now_ns() / 1000;
    for (int i = 0; i < count; i++) {
        values[i].timestamp = t;
        values[i].latencyUsec = 0;
        values[i].valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
        values[i].value.ullVal = 0;
        values[i].nvmlReturn = NVML_ERROR_NOT_SUPPORTED; /* unless a `field` line models it */
        for (unsigned k = 0; k < d->tel.nfield; k++) {
            if (d->tel.field_id[k] == values[i].fieldId && d->tel.field_scope[k] == values[i].scopeId) {
                values[i].valueType = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
                values[i].value.ullVal = d->tel.field_val[k];
                values[i].nvmlReturn = NVML_SUCCESS;
                break;
            }
        }
    }
    END();
}

/* Linux has no driver models (WDDM/TCC): always NOT_SUPPORTED. */
EXPORT nvmlReturn_t nvmlDeviceGetDriverModel_v2(nvmlDevice_t h, unsigned int *current, unsigned int *pending)
{
    (void)current;
    (void)pending;
    BEGIN_DEV(h, "nvmlDeviceGetDriverModel_v2", "nvmlDeviceGetDriverModel", 0);
    rc = NVML_ERROR_NOT_SUPPORTED;
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetDriverModel(nvmlDevice_t h, unsigned int *current, unsigned int *pending)
{
    (void)current;
    (void)pending;
    BEGIN_DEV(h, "nvmlDeviceGetDriverModel", NULL, 0);
    rc = NVML_ERROR_NOT_SUPPORTED;
    END();
}

/* ------------------------------------------------------------------------ */
/* processes                                                                */
/* ------------------------------------------------------------------------ */

enum { PROC_COMPUTE, PROC_GRAPHICS, PROC_MPS };

static int proc_visible(const fproc_t *p, const fmig_t *m)
{
    return !m || (p->gi == m->gi && p->ci == m->ci);
}

static nvmlReturn_t running_processes(nvmlDevice_t h, unsigned *count, void *infos, int kind, int v1,
                                      const char *fn, const char *family)
{
    BEGIN_DEV(h, fn, family, 1);
    NONNULL(count);
    const fproc_t *list = NULL;
    unsigned total = 0, n = 0;
    if (kind == PROC_COMPUTE) {
        list = d->procs;
        total = d->nproc;
    } else if (kind == PROC_GRAPHICS) {
        list = d->gprocs;
        total = d->ngproc;
    }
    for (unsigned i = 0; i < total; i++)
        n += (unsigned)proc_visible(&list[i], m);
    if (n == 0) {
        *count = 0;
        RET(NVML_SUCCESS);
    }
    if (!infos || *count < n) {
        *count = n;
        RET(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    unsigned k = 0;
    for (unsigned i = 0; i < total; i++) {
        const fproc_t *p = &list[i];
        if (!proc_visible(p, m))
            continue;
        if (v1) {
            nvmlProcessInfo_v1_t *o = (nvmlProcessInfo_v1_t *)infos + k;
            o->pid = p->pid;
            o->usedGpuMemory = p->mem;
        } else {
            nvmlProcessInfo_t *o = (nvmlProcessInfo_t *)infos + k;
            o->pid = p->pid;
            o->usedGpuMemory = p->mem;
            o->gpuInstanceId = p->gi;
            o->computeInstanceId = p->ci;
        }
        k++;
    }
    *count = n;
    END();
}

#define PROC_FN(name, kind, v1, family)                                               \
    EXPORT nvmlReturn_t name(nvmlDevice_t h, unsigned int *count, void *infos)       \
    {                                                                                 \
        return running_processes(h, count, infos, kind, v1, #name, family);          \
    }

PROC_FN(nvmlDeviceGetComputeRunningProcesses, PROC_COMPUTE, 1, NULL)
PROC_FN(nvmlDeviceGetComputeRunningProcesses_v2, PROC_COMPUTE, 0, "nvmlDeviceGetComputeRunningProcesses")
PROC_FN(nvmlDeviceGetComputeRunningProcesses_v3, PROC_COMPUTE, 0, "nvmlDeviceGetComputeRunningProcesses")
PROC_FN(nvmlDeviceGetGraphicsRunningProcesses, PROC_GRAPHICS, 1, NULL)
PROC_FN(nvmlDeviceGetGraphicsRunningProcesses_v2, PROC_GRAPHICS, 0, "nvmlDeviceGetGraphicsRunningProcesses")
PROC_FN(nvmlDeviceGetGraphicsRunningProcesses_v3, PROC_GRAPHICS, 0, "nvmlDeviceGetGraphicsRunningProcesses")
PROC_FN(nvmlDeviceGetMPSComputeRunningProcesses, PROC_MPS, 1, NULL)
PROC_FN(nvmlDeviceGetMPSComputeRunningProcesses_v2, PROC_MPS, 0, "nvmlDeviceGetMPSComputeRunningProcesses")
PROC_FN(nvmlDeviceGetMPSComputeRunningProcesses_v3, PROC_MPS, 0, "nvmlDeviceGetMPSComputeRunningProcesses")

/* ------------------------------------------------------------------------ */
/* MIG                                                                      */
/* ------------------------------------------------------------------------ */

EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t h, unsigned int *current, unsigned int *pending)
{
    BEGIN_DEV(h, "nvmlDeviceGetMigMode", NULL, 0);
    NONNULL(current);
    NONNULL(pending);
    REQUIRE(F_MIG_MODE);
    *current = d->mig_mode;
    *pending = d->mig_pending;
    END();
}

static unsigned mig_max_count(const fdev_t *d)
{
    if (HAS(d, F_MIG_MAX))
        return d->mig_max > d->nmig ? d->mig_max : d->nmig;
    return d->nmig > 7 ? d->nmig : 7;
}

EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t h, unsigned int *count)
{
    BEGIN_DEV(h, "nvmlDeviceGetMaxMigDeviceCount", NULL, 0);
    NONNULL(count);
    REQUIRE(F_MIG_MODE);
    *count = mig_max_count(d);
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t h, unsigned int index, nvmlDevice_t *mig)
{
    BEGIN_DEV(h, "nvmlDeviceGetMigDeviceHandleByIndex", NULL, 0);
    NONNULL(mig);
    REQUIRE(F_MIG_MODE);
    if (index >= mig_max_count(d))
        RET(NVML_ERROR_INVALID_ARGUMENT);
    if (d->mig_mode != 1 || index >= d->nmig)
        RET(NVML_ERROR_NOT_FOUND);
    *mig = (nvmlDevice_t)(void *)&g_hmig[d - g_cur->devs][index];
    END();
}

EXPORT nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t h, unsigned int *isMig)
{
    BEGIN_DEV(h, "nvmlDeviceIsMigDeviceHandle", NULL, 1);
    NONNULL(isMig);
    *isMig = m ? 1u : 0u;
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t h, nvmlDevice_t *device)
{
    BEGIN_DEV(h, "nvmlDeviceGetDeviceHandleFromMigDeviceHandle", NULL, 1);
    NONNULL(device);
    if (!m)
        RET(NVML_ERROR_INVALID_ARGUMENT);
    *device = (nvmlDevice_t)(void *)&g_hdev[d - g_cur->devs];
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t h, unsigned int *id)
{
    BEGIN_DEV(h, "nvmlDeviceGetGpuInstanceId", NULL, 1);
    NONNULL(id);
    if (!m)
        RET(NVML_ERROR_NOT_SUPPORTED);
    *id = m->gi;
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t h, unsigned int *id)
{
    BEGIN_DEV(h, "nvmlDeviceGetComputeInstanceId", NULL, 1);
    NONNULL(id);
    if (!m)
        RET(NVML_ERROR_NOT_SUPPORTED);
    *id = m->ci;
    END();
}

/* ------------------------------------------------------------------------ */
/* topology                                                                 */
/* ------------------------------------------------------------------------ */

#define NVML_P2P_CAPS_INDEX_NVLINK 2
#define NVML_P2P_STATUS_OK 0
#define NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED 3
#define NVML_P2P_STATUS_NOT_SUPPORTED 5
#define TOPO_INFO ((1ull << F_NUMA) | (1ull << F_SWITCH) | (1ull << F_BRIDGE))

/* the second handle of a two-device call (g_mu held) */
static nvmlReturn_t resolve_peer(void *h, const char *fn, fdev_t **dp)
{
    fmig_t *m;
    return resolve(h, fn, NULL, 0, dp, &m);
}

/* the NVML level between two devices of the state; -1 when neither says anything */
static int topo_level(const fdev_t *a, const fdev_t *b)
{
    unsigned ia = (unsigned)(a - g_cur->devs), ib = (unsigned)(b - g_cur->devs);
    if (ia == ib)
        return 0;
    for (unsigned k = 0; k < a->nlevel; k++)
        if (a->level_peer[k] == ib)
            return (int)a->level_value[k];
    for (unsigned k = 0; k < b->nlevel; k++)
        if (b->level_peer[k] == ia)
            return (int)b->level_value[k];
    if (!(a->has & TOPO_INFO) && !(b->has & TOPO_INFO))
        return -1;
    if (HAS(a, F_SWITCH) && HAS(b, F_SWITCH) && a->pcie_switch == b->pcie_switch)
        return 10;
    if (HAS(a, F_BRIDGE) && HAS(b, F_BRIDGE) && a->host_bridge == b->host_bridge)
        return 30;
    if (HAS(a, F_NUMA) && HAS(b, F_NUMA) && a->numa_node == b->numa_node)
        return 40;
    return 50;
}

static int link_to(const fdev_t *a, unsigned k, const fdev_t *b)
{
    return HAS(b, F_PCI) && a->link_dom[k] == b->domain && a->link_bus[k] == b->bus && a->link_dev[k] == b->dev &&
           a->link_fn[k] == b->func;
}

/* is the remote end of a's link k a GPU of this state? (else: an NVSwitch) */
static int link_to_gpu(const fdev_t *a, unsigned k)
{
    for (unsigned i = 0; i < g_cur->ndev; i++)
        if (link_to(a, k, &g_cur->devs[i]))
            return 1;
    return 0;
}

static int nvlinked(const fdev_t *a, const fdev_t *b)
{
    for (unsigned k = 0; k < a->nlink; k++)
        if (link_to(a, k, b))
            return 1;
    for (unsigned k = 0; k < b->nlink; k++)
        if (link_to(b, k, a))
            return 1;
    int sa = 0, sb = 0; /* both reach an NVSwitch */
    for (unsigned k = 0; k < a->nlink; k++)
        sa |= !link_to_gpu(a, k);
    for (unsigned k = 0; k < b->nlink; k++)
        sb |= !link_to_gpu(b, k);
    return sa && sb;
}

EXPORT nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t h1, nvmlDevice_t h2, int *level)
{
    BEGIN_DEV(h1, "nvmlDeviceGetTopologyCommonAncestor", NULL, 0);
    NONNULL(level);
    fdev_t *d2;
    rc = resolve_peer((void *)h2, "nvmlDeviceGetTopologyCommonAncestor", &d2);
    if (rc != NVML_SUCCESS)
        goto out;
    int lv = topo_level(d, d2);
    if (lv < 0)
        RET(NVML_ERROR_NOT_SUPPORTED);
    *level = lv;
    END();
}

/* The GPUs whose PCIe path meets h's at or below level (h itself not included).  *count 0: the
 * number; else up to *count handles.  NOT_SUPPORTED where no level with another GPU is known. */
EXPORT nvmlReturn_t nvmlDeviceGetTopologyNearestGpus(nvmlDevice_t h, int level, unsigned int *count,
                                                    nvmlDevice_t *devices)
{
    BEGIN_DEV(h, "nvmlDeviceGetTopologyNearestGpus", NULL, 0);
    NONNULL(count);
    if (level < 0 || level > 50 || (*count && !devices))
        RET(NVML_ERROR_INVALID_ARGUMENT);
    unsigned n = 0, known = 0;
    for (unsigned i = 0; i < g_cur->ndev; i++) {
        fdev_t *o = &g_cur->devs[i];
        if (o == d)
            continue;
        int lv = topo_level(d, o);
        if (lv < 0)
            continue;
        known = 1;
        if (lv > level)
            continue;
        if (*count && n < *count)
            devices[n] = (nvmlDevice_t)(void *)&g_hdev[i];
        n++;
    }
    if (!known && g_cur->ndev > 1)
        RET(NVML_ERROR_NOT_SUPPORTED);
    if (*count && n > *count)
        n = *count;
    *count = n;
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetP2PStatus(nvmlDevice_t h1, nvmlDevice_t h2, int p2pIndex, int *status)
{
    BEGIN_DEV(h1, "nvmlDeviceGetP2PStatus", NULL, 0);
    NONNULL(status);
    fdev_t *d2;
    rc = resolve_peer((void *)h2, "nvmlDeviceGetP2PStatus", &d2);
    if (rc != NVML_SUCCESS)
        goto out;
    if (p2pIndex < 0 || p2pIndex > 6)
        RET(NVML_ERROR_INVALID_ARGUMENT);
    if (p2pIndex == NVML_P2P_CAPS_INDEX_NVLINK) {
        *status = nvlinked(d, d2) ? NVML_P2P_STATUS_OK : NVML_P2P_STATUS_NOT_SUPPORTED;
    } else {
        int lv = topo_level(d, d2);
        *status = lv == 50 ? NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED : NVML_P2P_STATUS_OK;
    }
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t h, unsigned int link, int *isActive)
{
    BEGIN_DEV(h, "nvmlDeviceGetNvLinkState", NULL, 0);
    NONNULL(isActive);
    if (!d->nlink)
        RET(NVML_ERROR_NOT_SUPPORTED);
    if (link >= MAX_LINKS)
        RET(NVML_ERROR_INVALID_ARGUMENT);
    *isActive = link < d->nlink;
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t h, unsigned int link, nvmlPciInfo_t *pci)
{
    BEGIN_DEV(h, "nvmlDeviceGetNvLinkRemotePciInfo_v2", "nvmlDeviceGetNvLinkRemotePciInfo", 0);
    NONNULL(pci);
    if (!d->nlink)
        RET(NVML_ERROR_NOT_SUPPORTED);
    if (link >= MAX_LINKS)
        RET(NVML_ERROR_INVALID_ARGUMENT);
    if (link >= d->nlink)
        RET(NVML_ERROR_NOT_SUPPORTED); /* an inactive link has no remote end */
    memset(pci, 0, sizeof *pci);
    pci->domain = d->link_dom[link];
    pci->bus = d->link_bus[link];
    pci->device = d->link_dev[link];
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.%X", pci->domain, pci->bus, pci->device,
             d->link_fn[link]);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", pci->domain & 0xFFFF, pci->bus,
             pci->device, d->link_fn[link]);
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo(nvmlDevice_t h, unsigned int link, nvmlPciInfo_t *pci)
{
    return nvmlDeviceGetNvLinkRemotePciInfo_v2(h, link, pci);
}

EXPORT nvmlReturn_t nvmlDeviceGetCpuAffinity(nvmlDevice_t h, unsigned int cpuSetSize, unsigned long *cpuSet)
{
    BEGIN_DEV(h, "nvmlDeviceGetCpuAffinity", NULL, 0);
    NONNULL(cpuSet);
    REQUIRE(F_CPUS);
    for (unsigned i = 0; i < cpuSetSize; i++)
        cpuSet[i] = i < MAX_CPU_WORDS ? (unsigned long)d->cpus[i] : 0ul;
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t h, unsigned int *node)
{
    BEGIN_DEV(h, "nvmlDeviceGetNumaNodeId", NULL, 0);
    NONNULL(node);
    REQUIRE(F_NUMA);
    *node = d->numa_node;
    END();
}

/* ------------------------------------------------------------------------ */
/* test support (not part of NVML)                                          */
/* ------------------------------------------------------------------------ */

/* sizeof() of the structs above, by their pynvml ctypes name; 0 if unknown */
EXPORT unsigned long fake_nvml_sizeof(const char *name)
{
    static const struct { const char *name; unsigned long size; } sizes[] = {
        {"nvmlPciInfo_t", sizeof(nvmlPciInfo_t)},
        {"nvmlPciInfo_v2_t", sizeof(nvmlPciInfo_v2_t)},
        {"nvmlPciInfoExt_v1_t", sizeof(nvmlPciInfoExt_t)},
        {"c_nvmlMemory_t", sizeof(nvmlMemory_t)},
        {"c_nvmlMemory_v2_t", sizeof(nvmlMemory_v2_t)},
        {"c_nvmlBAR1Memory_t", sizeof(nvmlBAR1Memory_t)},
        {"c_nvmlProcessInfo_v2_t", sizeof(nvmlProcessInfo_t)},
        {"c_nvmlProcessInfo_v1_t", sizeof(nvmlProcessInfo_v1_t)},
        {"c_nvmlUtilization_t", sizeof(nvmlUtilization_t)},
        {"c_nvmlValue_t", sizeof(nvmlValue_t)},
        {"c_nvmlSample_t", sizeof(nvmlSample_t)},
        {"c_nvmlFieldValue_t", sizeof(nvmlFieldValue_t)},
        {"c_nvmlTemperature_v1_t", sizeof(nvmlTemperature_t)},
        {"c_nvmlProcessUtilizationSample_t", sizeof(nvmlProcessUtilizationSample_t)},
    };
    if (!name)
        return 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        if (!strcmp(sizes[i].name, name))
            return sizes[i].size;
    return 0;
}

/* offsetof() of selected fields, "struct.field"; (unsigned long)-1 if unknown */
EXPORT unsigned long fake_nvml_offsetof(const char *name)
{
#define OFF(s, cs, f) {s "." #f, offsetof(cs, f)}
    static const struct { const char *name; unsigned long off; } offs[] = {
        OFF("nvmlPciInfo_t", nvmlPciInfo_t, busId),
        OFF("nvmlPciInfo_t", nvmlPciInfo_t, pciSubSystemId),
        OFF("nvmlPciInfo_v2_t", nvmlPciInfo_v2_t, pciSubSystemId),
        OFF("nvmlPciInfoExt_v1_t", nvmlPciInfoExt_t, busId),
        OFF("c_nvmlMemory_v2_t", nvmlMemory_v2_t, total),
        OFF("c_nvmlMemory_v2_t", nvmlMemory_v2_t, used),
        OFF("c_nvmlProcessInfo_v2_t", nvmlProcessInfo_t, usedGpuMemory),
        OFF("c_nvmlProcessInfo_v2_t", nvmlProcessInfo_t, gpuInstanceId),
        OFF("c_nvmlProcessInfo_v2_t", nvmlProcessInfo_t, computeInstanceId),
        OFF("c_nvmlSample_t", nvmlSample_t, sampleValue),
        OFF("c_nvmlFieldValue_t", nvmlFieldValue_t, timestamp),
        OFF("c_nvmlFieldValue_t", nvmlFieldValue_t, nvmlReturn),
        OFF("c_nvmlFieldValue_t", nvmlFieldValue_t, value),
        OFF("c_nvmlTemperature_v1_t", nvmlTemperature_t, temperature),
        OFF("c_nvmlProcessUtilizationSample_t", nvmlProcessUtilizationSample_t, timeStamp),
        OFF("c_nvmlProcessUtilizationSample_t", nvmlProcessUtilizationSample_t, decUtil),
    };
#undef OFF
    if (!name)
        return (unsigned long)-1;
    for (size_t i = 0; i < sizeof offs / sizeof offs[0]; i++)
        if (!strcmp(offs[i].name, name))
            return offs[i].off;
    return (unsigned long)-1;
}

/* ------------------------------------------------------------------------ */
/* telemetry (issue 25): energy, PCIe replays, remapped rows, XID events    */
/* ------------------------------------------------------------------------ */

EXPORT nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t h, ull *energy)
{
    BEGIN_DEV(h, "nvmlDeviceGetTotalEnergyConsumption", NULL, 0);
    NONNULL(energy);
    if (!d->tel.has_energy)
        RET(NVML_ERROR_NOT_SUPPORTED);
    {
        long long dt = mono_ns() - d->tel.energy_t0_ns; /* ns since the file was loaded */
        ull mw = HAS(d, F_POWER_USAGE) ? d->power_usage : 0;
        *energy = d->tel.energy + (ull)((double)mw * (double)(dt > 0 ? dt : 0) / 1e9);
    }
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetPcieReplayCounter(nvmlDevice_t h, unsigned int *value)
{
    BEGIN_DEV(h, "nvmlDeviceGetPcieReplayCounter", NULL, 0);
    NONNULL(value);
    if (!d->tel.has_replay)
        RET(NVML_ERROR_NOT_SUPPORTED);
    *value = d->tel.replay;
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t h, unsigned int *corr, unsigned int *unc,
                                              unsigned int *pending, unsigned int *failure)
{
    BEGIN_DEV(h, "nvmlDeviceGetRemappedRows", NULL, 0);
    NONNULL(corr);
    NONNULL(unc);
    NONNULL(pending);
    NONNULL(failure);
    if (!d->tel.has_remap)
        RET(NVML_ERROR_NOT_SUPPORTED);
    *corr = d->tel.remap_corr;
    *unc = d->tel.remap_unc;
    *pending = d->tel.remap_pending;
    *failure = d->tel.remap_failure;
    END();
}

/* Event sets.  A set delivers the `xid` lines that appear for a registered
 * device after its registration (a rewrite of the state file with more `xid`
 * lines is "the XIDs that happened since"). */
#define NVML_EVENT_TYPE_XID 0x8ull
#define MAX_EVSETS 16
typedef struct {
    unsigned int magic;
    int used;
    ull mask[MAX_GPUS];
    unsigned int delivered[MAX_GPUS];
} fevset_t;
static fevset_t g_evsets[MAX_EVSETS];
#define EVSET_MAGIC 0x45565354u
typedef fevset_t *nvmlEventSet_t;

/* pynvml: c_nvmlEventData_t */
typedef struct {
    nvmlDevice_t device;
    ull eventType;
    ull eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

static fevset_t *evset(nvmlEventSet_t set)
{
    for (int i = 0; i < MAX_EVSETS; i++)
        if (set == &g_evsets[i] && g_evsets[i].used && g_evsets[i].magic == EVSET_MAGIC)
            return &g_evsets[i];
    return NULL;
}

EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    BEGIN();
    NONNULL(set);
    for (int i = 0; i < MAX_EVSETS; i++) {
        if (!g_evsets[i].used) {
            memset(&g_evsets[i], 0, sizeof g_evsets[i]);
            g_evsets[i].used = 1;
            g_evsets[i].magic = EVSET_MAGIC;
            *set = &g_evsets[i];
            RET(NVML_SUCCESS);
        }
    }
    rc = NVML_ERROR_INSUFFICIENT_RESOURCES;
    END();
}

EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    BEGIN();
    fevset_t *e = evset(set);
    if (!e)
        RET(NVML_ERROR_INVALID_ARGUMENT);
    e->used = 0;
    e->magic = 0;
    END();
}

EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t h, ull *types)
{
    BEGIN_DEV(h, "nvmlDeviceGetSupportedEventTypes", NULL, 0);
    NONNULL(types);
    *types = d->tel.no_events ? 0 : NVML_EVENT_TYPE_XID;
    END();
}

EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t h, ull types, nvmlEventSet_t set)
{
    BEGIN_DEV(h, "nvmlDeviceRegisterEvents", NULL, 0);
    fevset_t *e = evset(set);
    if (!e)
        RET(NVML_ERROR_INVALID_ARGUMENT);
    if (d->tel.no_events || (types & ~NVML_EVENT_TYPE_XID))
        RET(NVML_ERROR_NOT_SUPPORTED);
    {
        unsigned di = (unsigned)(d - g_cur->devs);
        if (!(e->mask[di] & NVML_EVENT_TYPE_XID))
            e->delivered[di] = d->tel.nxid; /* only what happens from now on */
        e->mask[di] |= types;
    }
    END();
}

static nvmlReturn_t event_wait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms, int v2)
{
    long long deadline = mono_ns() + (long long)timeoutms * 1000000ll;
    for (;;) {
        nvmlReturn_t rc;
        pthread_mutex_lock(&g_mu);
        rc = enter();
        if (rc == NVML_SUCCESS) {
            fevset_t *e = evset(set);
            rc = NVML_ERROR_TIMEOUT;
            if (!e || !data) {
                rc = NVML_ERROR_INVALID_ARGUMENT;
            } else {
                for (unsigned di = 0; di < g_cur->ndev && di < MAX_GPUS; di++) {
                    ftel_t *t = &g_cur->devs[di].tel;
                    if (!(e->mask[di] & NVML_EVENT_TYPE_XID))
                        continue;
                    if (e->delivered[di] > t->nxid)
                        e->delivered[di] = t->nxid; /* the file lost lines: start over from there */
                    if (e->delivered[di] < t->nxid) {
                        data->device = (nvmlDevice_t)(void *)&g_hdev[di];
                        data->eventType = NVML_EVENT_TYPE_XID;
                        data->eventData = t->xid[e->delivered[di]++];
                        if (v2) {
                            data->gpuInstanceId = NVML_NO_ID;
                            data->computeInstanceId = NVML_NO_ID;
                        }
                        rc = NVML_SUCCESS;
                        break;
                    }
                }
            }
        }
        pthread_mutex_unlock(&g_mu);
        if (rc != NVML_ERROR_TIMEOUT || mono_ns() >= deadline)
            return rc;
        struct timespec nap = {0, 10 * 1000000l}; /* 10 ms, without the lock */
        nanosleep(&nap, NULL);
    }
}

EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    return event_wait(set, data, timeoutms, 1);
}

EXPORT nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    return event_wait(set, data, timeoutms, 0);
}

/* GPM (GPU performance monitoring, Hopper and newer): `gpm <metric id> <value>` lines.  A sample
 * remembers its device; nvmlGpmMetricsGet between two samples of one device answers each metric that
 * has a line (its value), NOT_SUPPORTED the others. */
#define MAX_GPM_SAMPLES 256
#define GPM_SAMPLE_MAGIC 0x47504d53u
typedef struct {
    unsigned int magic;
    int used, taken;
    unsigned int dev;
    long long t_ns;
} fgpmsample_t;
static fgpmsample_t g_gpm[MAX_GPM_SAMPLES];

typedef struct {
    char *shortName, *longName, *unit;
} nvmlGpmMetricInfo_t;
typedef struct {
    unsigned int metricId;
    nvmlReturn_t nvmlReturn;
    double value;
    nvmlGpmMetricInfo_t metricInfo;
} nvmlGpmMetric_t;
#define NVML_GPM_METRIC_MAX 477
typedef struct {
    unsigned int version;
    unsigned int numMetrics;
    fgpmsample_t *sample1, *sample2;
    nvmlGpmMetric_t metrics[NVML_GPM_METRIC_MAX];
} nvmlGpmMetricsGet_t;
typedef struct {
    unsigned int version;
    unsigned int isSupportedDevice;
} nvmlGpmSupport_t;

static fgpmsample_t *gpm_sample(fgpmsample_t *p)
{
    for (int i = 0; i < MAX_GPM_SAMPLES; i++)
        if (p == &g_gpm[i] && g_gpm[i].used && g_gpm[i].magic == GPM_SAMPLE_MAGIC)
            return p;
    return NULL;
}

EXPORT nvmlReturn_t nvmlGpmQueryDeviceSupport(nvmlDevice_t h, nvmlGpmSupport_t *support)
{
    BEGIN_DEV(h, "nvmlGpmQueryDeviceSupport", NULL, 0);
    NONNULL(support);
    if (support->version != 1)
        RET(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    support->isSupportedDevice = d->tel.gpm ? 1 : 0;
    END();
}

EXPORT nvmlReturn_t nvmlGpmSampleAlloc(fgpmsample_t **sample)
{
    BEGIN();
    NONNULL(sample);
    for (int i = 0; i < MAX_GPM_SAMPLES; i++) {
        if (!g_gpm[i].used) {
            memset(&g_gpm[i], 0, sizeof g_gpm[i]);
            g_gpm[i].used = 1;
            g_gpm[i].magic = GPM_SAMPLE_MAGIC;
            *sample = &g_gpm[i];
            RET(NVML_SUCCESS);
        }
    }
    rc = NVML_ERROR_MEMORY;
    END();
}

EXPORT nvmlReturn_t nvmlGpmSampleFree(fgpmsample_t *sample)
{
    BEGIN();
    fgpmsample_t *s = gpm_sample(sample);
    if (!s)
        RET(NVML_ERROR_INVALID_ARGUMENT);
    s->used = 0;
    s->magic = 0;
    END();
}

EXPORT nvmlReturn_t nvmlGpmSampleGet(nvmlDevice_t h, fgpmsample_t *sample)
{
    BEGIN_DEV(h, "nvmlGpmSampleGet", NULL, 0);
    fgpmsample_t *s = gpm_sample(sample);
    if (!s)
        RET(NVML_ERROR_INVALID_ARGUMENT);
    if (!d->tel.gpm)
        RET(NVML_ERROR_NOT_SUPPORTED);
    s->taken = 1;
    s->dev = (unsigned)(d - g_cur->devs);
    s->t_ns = mono_ns();
    END();
}

EXPORT nvmlReturn_t nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *mg)
{
    BEGIN();
    NONNULL(mg);
    if (mg->version != 1)
        RET(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    fgpmsample_t *a = gpm_sample(mg->sample1), *b = gpm_sample(mg->sample2);
    if (!a || !b || !a->taken || !b->taken || a->dev != b->dev || b->t_ns <= a->t_ns ||
        mg->numMetrics > NVML_GPM_METRIC_MAX)
        RET(NVML_ERROR_INVALID_ARGUMENT);
    if (a->dev >= g_cur->ndev)
        RET(NVML_ERROR_GPU_IS_LOST);
    {
        ftel_t *t = &g_cur->devs[a->dev].tel;
        for (unsigned i = 0; i < mg->numMetrics; i++) {
            nvmlGpmMetric_t *m = &mg->metrics[i];
            m->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
            m->value = 0;
            m->metricInfo.shortName = m->metricInfo.longName = m->metricInfo.unit = NULL;
            for (unsigned k = 0; k < t->ngpm; k++) {
                if (t->gpm_id[k] == m->metricId) {
                    m->value = (double)t->gpm_val[k];
                    m->nvmlReturn = NVML_SUCCESS;
                    break;
                }
            }
        }
    }
    END();
}
