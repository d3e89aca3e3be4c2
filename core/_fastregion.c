/* The region path's per-op bookkeeping in C: smddp.client.shm.ShmPath's hot methods.

   A rank's side of a communicator's control region (core/region.py has the layout, the
   protocol is client/shm.py's): publishing an op's signature and arriving, spinning until the
   others have, comparing the signatures, counting the completed op, and the all_reduce's
   copy in and reduction for the common dtypes. Each is a few dozen loads and stores, which
   cost the interpreter microseconds an op; here they cost nanoseconds. Everything that is not
   the common case stays in Python: sleeping (futex slices, watching the daemon), raising the
   alarm's error, the mismatch message, dtypes and reductions other than SUM and AVG of
   float32, float64, int32 and int64.

   The layout's numbers come from core/region.py at construction (LAYOUT names them in the
   order expected), so the layout is written down once. Results are bitwise numpy's: the same
   IEEE additions in the same rank order (no -ffast-math; integers wrap as numpy's do). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <linux/futex.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* Names of the layout constants, in the order Slot() takes their values. */
static const char *const LAYOUT[] = {
    "HEADER_BYTES", "H_ALARM",          "S_STEP",      "S_SLEEPING", "S_SEQ",
    "S_DONE",       "S_LAST",           "S_OPS",       "SIG_WORD",   "SIG_WORDS",
    "G_SEQ",        "G_KIND",           "G_DTYPE",     "G_COUNT",    "G_ROOT",
    "G_OP",         "G_ARRIVAL",        "G_PACKED",    "OP_TABLE_OFFSET",
    "SKEW_TABLE_OFFSET", "DATA_OFFSET", "KINDS",       "DTYPES",     "OP_COLS",
    "C_OPS",        "C_BYTES",          "C_DUR_SUM",   "C_DUR_BUCKET", "SKEW_COLS",
    "K_COUNT",      "K_SUM",            "K_BUCKET",
};
enum {
    L_HEADER_BYTES, L_H_ALARM, L_S_STEP, L_S_SLEEPING, L_S_SEQ,
    L_S_DONE, L_S_LAST, L_S_OPS, L_SIG_WORD, L_SIG_WORDS,
    L_G_SEQ, L_G_KIND, L_G_DTYPE, L_G_COUNT, L_G_ROOT,
    L_G_OP, L_G_ARRIVAL, L_G_PACKED, L_OP_TABLE_OFFSET,
    L_SKEW_TABLE_OFFSET, L_DATA_OFFSET, L_KINDS, L_DTYPES, L_OP_COLS,
    L_C_OPS, L_C_BYTES, L_C_DUR_SUM, L_C_DUR_BUCKET, L_SKEW_COLS,
    L_K_COUNT, L_K_SUM, L_K_BUCKET,
    L_COUNT
};

_Static_assert(sizeof(LAYOUT) / sizeof(LAYOUT[0]) == L_COUNT, "LAYOUT and its enum differ");

#define MAX_BOUNDS 64
#define MAX_INPUTS 256 /* the most ranks a reduction in C takes (more: numpy) */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

typedef struct {
    PyObject_HEAD
    Py_buffer region;    /* held for the Slot's lifetime: the mapping cannot go before it */
    int held;            /* whether region holds a buffer */
    int64_t *q;          /* the region as int64 words */
    char *bytes;         /* the region's first byte */
    Py_ssize_t world, rank, slot_bytes, data_bytes;
    int64_t step;        /* this rank's step counter (mirrors its step word) */
    int64_t spin_ns;
    long sum_op, avg_op; /* the wire ReduceOp values of SUM and AVG */
    Py_ssize_t l[L_COUNT];
    Py_ssize_t base;     /* word index of this rank's slot */
    Py_ssize_t nbounds;
    int64_t bounds[MAX_BOUNDS]; /* the latency buckets' upper bounds, ns, ascending */
} Slot;

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* time.monotonic_ns()'s clock */
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline Py_ssize_t slot_base(const Slot *s, Py_ssize_t r) {
    return (s->l[L_HEADER_BYTES] + r * s->slot_bytes) / 8;
}

static inline int64_t load(const int64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

static inline void store(int64_t *p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

static inline char *data(const Slot *s, Py_ssize_t r, long parity) {
    return s->bytes + s->l[L_HEADER_BYTES] + r * s->slot_bytes + s->l[L_DATA_OFFSET] +
           parity * s->data_bytes;
}

static Py_ssize_t bisect_left(const Slot *s, int64_t x) {
    Py_ssize_t lo = 0, hi = s->nbounds;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (s->bounds[mid] < x)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static void release_region(Slot *self) {
    if (self->held) {
        self->held = 0;
        self->q = NULL;
        self->bytes = NULL;
        PyBuffer_Release(&self->region);
    }
}

/* Whether [offset, offset + bytes) lies within [0, limit). */
static int within(Py_ssize_t offset, Py_ssize_t bytes, Py_ssize_t limit) {
    return offset >= 0 && bytes >= 0 && offset <= limit && bytes <= limit - offset;
}

static int Slot_init(Slot *self, PyObject *args, PyObject *kwds) {
    PyObject *region;
    Py_ssize_t rank, world, slot_bytes, data_bytes;
    long long spin_ns;
    long sum_op, avg_op;
    PyObject *layout, *bounds;
    if (!PyArg_ParseTuple(args, "OnnnnLO!O!ll", &region, &rank, &world, &slot_bytes,
                          &data_bytes, &spin_ns, &PyTuple_Type, &layout, &PyTuple_Type,
                          &bounds, &sum_op, &avg_op))
        return -1;
    release_region(self); /* __init__ called again */
    if (PyTuple_GET_SIZE(layout) != L_COUNT) {
        PyErr_Format(PyExc_ValueError, "Slot: layout has %zd values, expected %d",
                     PyTuple_GET_SIZE(layout), (int)L_COUNT);
        return -1;
    }
    if (PyTuple_GET_SIZE(bounds) > MAX_BOUNDS) {
        PyErr_SetString(PyExc_ValueError, "Slot: too many latency buckets");
        return -1;
    }
    if (world < 1 || rank < 0 || rank >= world || slot_bytes <= 0 || slot_bytes % 8 ||
        data_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "Slot: bad rank, world or alignment");
        return -1;
    }
    for (Py_ssize_t i = 0; i < L_COUNT; i++) {
        self->l[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(layout, i));
        if (self->l[i] == -1 && PyErr_Occurred())
            return -1;
    }
    const Py_ssize_t *l = self->l;
    /* Every word and buffer the methods touch must lie inside the region: its header, each
       slot's words, signatures, tables and two data buffers. */
    int fits = l[L_HEADER_BYTES] >= 0 && l[L_HEADER_BYTES] % 8 == 0 &&
               world <= (PY_SSIZE_T_MAX - l[L_HEADER_BYTES]) / slot_bytes &&
               within(l[L_H_ALARM] * 8, 8, l[L_HEADER_BYTES]) &&
               data_bytes <= PY_SSIZE_T_MAX / 2 &&
               within(l[L_DATA_OFFSET], 2 * data_bytes, slot_bytes) &&
               l[L_SIG_WORDS] > 0 && within(l[L_SIG_WORD] * 8, 16 * l[L_SIG_WORDS], slot_bytes) &&
               l[L_OP_TABLE_OFFSET] % 8 == 0 && l[L_SKEW_TABLE_OFFSET] % 8 == 0 &&
               l[L_KINDS] > 0 && l[L_DTYPES] > 0 && l[L_OP_COLS] > 0 && l[L_SKEW_COLS] > 0 &&
               l[L_KINDS] <= 1024 && l[L_DTYPES] <= 1024 && l[L_OP_COLS] <= 1024 &&
               l[L_SKEW_COLS] <= 1024 &&
               within(l[L_OP_TABLE_OFFSET], 8 * l[L_KINDS] * l[L_DTYPES] * l[L_OP_COLS],
                      slot_bytes) &&
               within(l[L_SKEW_TABLE_OFFSET], 8 * l[L_KINDS] * l[L_SKEW_COLS], slot_bytes) &&
               PyTuple_GET_SIZE(bounds) < l[L_OP_COLS] - l[L_C_DUR_BUCKET] &&
               PyTuple_GET_SIZE(bounds) < l[L_SKEW_COLS] - l[L_K_BUCKET];
    const Py_ssize_t words[] = {L_S_STEP, L_S_SLEEPING, L_S_SEQ, L_S_DONE, L_S_LAST, L_S_OPS};
    for (size_t i = 0; fits && i < sizeof(words) / sizeof(words[0]); i++)
        fits = within(l[words[i]] * 8, 8, slot_bytes);
    const Py_ssize_t sig[] = {L_G_SEQ, L_G_KIND, L_G_DTYPE, L_G_COUNT,
                              L_G_ROOT, L_G_OP, L_G_ARRIVAL, L_G_PACKED};
    for (size_t i = 0; fits && i < sizeof(sig) / sizeof(sig[0]); i++)
        fits = within(l[sig[i]] * 8, 8, 8 * l[L_SIG_WORDS]);
    const Py_ssize_t op_cols[] = {L_C_OPS, L_C_BYTES, L_C_DUR_SUM, L_C_DUR_BUCKET};
    for (size_t i = 0; fits && i < sizeof(op_cols) / sizeof(op_cols[0]); i++)
        fits = l[op_cols[i]] >= 0 && l[op_cols[i]] < l[L_OP_COLS];
    const Py_ssize_t skew_cols[] = {L_K_COUNT, L_K_SUM, L_K_BUCKET};
    for (size_t i = 0; fits && i < sizeof(skew_cols) / sizeof(skew_cols[0]); i++)
        fits = l[skew_cols[i]] >= 0 && l[skew_cols[i]] < l[L_SKEW_COLS];
    if (!fits) {
        PyErr_SetString(PyExc_ValueError, "Slot: the layout does not fit a slot");
        return -1;
    }
    if (PyObject_GetBuffer(region, &self->region, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    self->held = 1;
    if ((uintptr_t)self->region.buf % 8 ||
        self->region.len < l[L_HEADER_BYTES] + world * slot_bytes) {
        PyErr_Format(PyExc_ValueError,
                     "Slot: a region of %zd bytes holds no header of %zd and %zd slots of %zd",
                     self->region.len, l[L_HEADER_BYTES], world, slot_bytes);
        release_region(self);
        return -1;
    }
    self->nbounds = PyTuple_GET_SIZE(bounds);
    for (Py_ssize_t i = 0; i < self->nbounds; i++) {
        self->bounds[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(bounds, i));
        if (self->bounds[i] == -1 && PyErr_Occurred())
            return -1;
    }
    self->bytes = (char *)self->region.buf;
    self->q = (int64_t *)self->bytes;
    self->rank = rank;
    self->world = world;
    self->slot_bytes = slot_bytes;
    self->data_bytes = data_bytes;
    self->spin_ns = spin_ns;
    self->sum_op = sum_op;
    self->avg_op = avg_op;
    self->base = slot_base(self, rank);
    self->step = self->q[self->base + self->l[L_S_STEP]];
    return 0;
}

/* A Slot made by __new__ alone, or whose __init__ failed, has no region: its methods raise. */
#define REQUIRE_REGION(self)                                                                \
    do {                                                                                    \
        if (!(self)->held) {                                                                \
            PyErr_SetString(PyExc_RuntimeError, "Slot: not initialised with a region");    \
            return NULL;                                                                    \
        }                                                                                   \
    } while (0)

static int64_t bump(Slot *s) {
    s->step += 1;
    int64_t *word = &s->q[s->base + s->l[L_S_STEP]];
    store(word, s->step);
    for (Py_ssize_t r = 0; r < s->world; r++) {
        if (load(&s->q[slot_base(s, r) + s->l[L_S_SLEEPING]])) {
            /* someone may sleep on a step word: wake ours (a shared futex, as region.py's) */
            syscall(SYS_futex, (void *)word, FUTEX_WAKE, 1 << 30, NULL, NULL, 0);
            break;
        }
    }
    return s->step;
}

static PyObject *Slot_bump(Slot *self, PyObject *unused) {
    REQUIRE_REGION(self);
    return PyLong_FromLongLong(bump(self));
}

/* The n integer arguments of a METH_FASTCALL method into v; 0, or -1 with the error set. */
static int int_args(const char *name, PyObject *const *args, Py_ssize_t nargs, int n,
                    long long *v) {
    if (nargs != n) {
        PyErr_Format(PyExc_TypeError, "%s() takes %d arguments (%zd given)", name, n, nargs);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        v[i] = PyLong_AsLongLong(args[i]);
        if (v[i] == -1 && PyErr_Occurred())
            return -1;
    }
    return 0;
}

/* publish(seq, parity, kind, dtype, count, root, reduce_op) -> step: ShmPath.publish */
static PyObject *Slot_publish(Slot *self, PyObject *const *args, Py_ssize_t nargs) {
    REQUIRE_REGION(self);
    long long v[7];
    if (int_args("publish", args, nargs, 7, v) < 0)
        return NULL;
    long long seq = v[0], parity = v[1] & 1, kind = v[2], dtype = v[3], count = v[4],
              root = v[5], op = v[6];
    int64_t *w = &self->q[self->base + self->l[L_SIG_WORD] + parity * self->l[L_SIG_WORDS]];
    w[self->l[L_G_SEQ]] = seq;
    w[self->l[L_G_KIND]] = kind;
    w[self->l[L_G_DTYPE]] = dtype;
    w[self->l[L_G_COUNT]] = count;
    w[self->l[L_G_ROOT]] = root;
    w[self->l[L_G_OP]] = op;
    w[self->l[L_G_ARRIVAL]] = now_ns();
    /* region.packed_signature */
    uint64_t packed = ((uint64_t)kind << 58) | ((uint64_t)dtype << 53) |
                      ((uint64_t)op << 49) | (((uint64_t)root & 0x3FFF) << 35) |
                      ((uint64_t)count & 0x7FFFFFFFFULL);
    w[self->l[L_G_PACKED]] = (int64_t)packed;
    self->q[self->base + self->l[L_S_SEQ]] = seq;
    return PyLong_FromLongLong(bump(self));
}

/* spin(target) -> 1 once every other rank's step has reached target, 0 when the spin time
   ran out first (the caller sleeps), -1 when the alarm word is set (the caller raises) */
static PyObject *Slot_spin(Slot *self, PyObject *arg) {
    REQUIRE_REGION(self);
    long long target = PyLong_AsLongLong(arg);
    if (target == -1 && PyErr_Occurred())
        return NULL;
    int64_t deadline = 0;
    for (Py_ssize_t r = 0; r < self->world; r++) {
        if (r == self->rank)
            continue;
        const int64_t *word = &self->q[slot_base(self, r) + self->l[L_S_STEP]];
        while (load(word) < target) {
            if (load(&self->q[self->l[L_H_ALARM]]))
                return PyLong_FromLong(-1);
            int64_t t = now_ns();
            if (!deadline)
                deadline = t + self->spin_ns;
            else if (t >= deadline)
                return PyLong_FromLong(0);
            cpu_relax();
        }
    }
    return PyLong_FromLong(1);
}

/* agree(seq, parity) -> True when every rank published the same signature for op seq */
static PyObject *Slot_agree(Slot *self, PyObject *const *args, Py_ssize_t nargs) {
    REQUIRE_REGION(self);
    long long v[2];
    if (int_args("agree", args, nargs, 2, v) < 0)
        return NULL;
    long long seq = v[0], parity = v[1];
    Py_ssize_t off = self->l[L_SIG_WORD] + (parity & 1) * self->l[L_SIG_WORDS];
    int64_t mine = self->q[self->base + off + self->l[L_G_PACKED]];
    for (Py_ssize_t r = 0; r < self->world; r++) {
        const int64_t *sig = &self->q[slot_base(self, r) + off];
        if (load(&sig[self->l[L_G_PACKED]]) != mine || load(&sig[self->l[L_G_SEQ]]) != seq)
            Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* done(seq, parity, kind, dtype, nbytes): ShmPath.done, the op's counters */
static PyObject *Slot_done(Slot *self, PyObject *const *args, Py_ssize_t nargs) {
    REQUIRE_REGION(self);
    long long v[5];
    if (int_args("done", args, nargs, 5, v) < 0)
        return NULL;
    long long seq = v[0], parity = v[1] & 1, kind = v[2], dtype = v[3], nbytes = v[4];
    if (kind < 0 || kind >= self->l[L_KINDS] || dtype < 0 || dtype >= self->l[L_DTYPES]) {
        PyErr_Format(PyExc_ValueError, "done(): kind %lld or dtype %lld out of range", kind,
                     dtype);
        return NULL;
    }
    Py_ssize_t arrival = self->l[L_SIG_WORD] + parity * self->l[L_SIG_WORDS] + self->l[L_G_ARRIVAL];
    int64_t first = 0, last = 0, mine = 0;
    Py_ssize_t last_rank = 0;
    for (Py_ssize_t r = 0; r < self->world; r++) {
        int64_t a = load(&self->q[slot_base(self, r) + arrival]);
        if (r == 0 || a < first)
            first = a;
        if (r == 0 || a > last) {
            last = a;
            last_rank = r; /* the first rank with the latest arrival, as list.index finds */
        }
        if (r == self->rank)
            mine = a;
    }
    int64_t took = now_ns() - first, skew = last - first;
    int64_t *q = self->q;
    Py_ssize_t e = self->base + self->l[L_OP_TABLE_OFFSET] / 8 +
                   (kind * self->l[L_DTYPES] + dtype) * self->l[L_OP_COLS];
    q[e + self->l[L_C_OPS]] += 1;
    q[e + self->l[L_C_BYTES]] += nbytes;
    q[e + self->l[L_C_DUR_SUM]] += took;
    q[e + self->l[L_C_DUR_BUCKET] + bisect_left(self, took)] += 1;
    Py_ssize_t k = self->base + self->l[L_SKEW_TABLE_OFFSET] / 8 + kind * self->l[L_SKEW_COLS];
    q[k + self->l[L_K_COUNT]] += 1;
    q[k + self->l[L_K_SUM]] += skew;
    q[k + self->l[L_K_BUCKET] + bisect_left(self, skew)] += 1;
    if (mine == last && last_rank == self->rank)
        q[self->base + self->l[L_S_LAST]] += 1;
    q[self->base + self->l[L_S_OPS]] += 1;
    q[self->base + self->l[L_S_DONE]] = seq;
    Py_RETURN_NONE;
}

/* fill(parity, array) -> True once a C-contiguous array's bytes are copied into this rank's
   data buffer; False (nothing copied) for an object that exports no such buffer */
static PyObject *Slot_fill(Slot *self, PyObject *const *args, Py_ssize_t nargs) {
    REQUIRE_REGION(self);
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "fill() takes 2 arguments");
        return NULL;
    }
    long parity = PyLong_AsLong(args[0]);
    if (parity == -1 && PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    if (view.len > self->data_bytes) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "fill(): %zd bytes exceed the buffer's %zd", view.len,
                     self->data_bytes);
        return NULL;
    }
    memcpy(data(self, self->rank, parity & 1), view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    Py_RETURN_TRUE;
}

/* The reductions: out[i] = ((ins[0][i] + ins[1][i]) + ins[2][i]) + ..., in rank order,
   element by element, then / world for AVG: the same IEEE operations as numpy's passes
   (smddp.client.region_ops.numpy_rank_order), so the same bits. The elements are taken in
   blocks that stay in the L1 cache, every input read once and out written once (numpy's
   passes read out again for each input past the second); the loops vectorise (-O3, and a
   clone per vector extension on x86-64). out aliases no input (the callers check). */
#define BLOCK 2048

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VECTOR_CLONES
#endif

#define KERNEL(NAME, T, U)                                                                  \
    VECTOR_CLONES static void NAME(char *out_, char *const *ins_, Py_ssize_t w, Py_ssize_t n, \
                                   int avg) {                                               \
        T *out = (T *)out_;                                                                 \
        for (Py_ssize_t b0 = 0; b0 < n; b0 += BLOCK) {                                      \
            const Py_ssize_t m = n - b0 < BLOCK ? n - b0 : BLOCK;                           \
            T *restrict o = out + b0;                                                       \
            const T *restrict a = (const T *)ins_[0] + b0;                                  \
            const T *restrict b = (const T *)ins_[1] + b0;                                  \
            for (Py_ssize_t i = 0; i < m; i++)                                              \
                o[i] = (T)((U)a[i] + (U)b[i]);                                              \
            for (Py_ssize_t r = 2; r < w; r++) {                                            \
                const T *restrict x = (const T *)ins_[r] + b0;                              \
                for (Py_ssize_t i = 0; i < m; i++)                                          \
                    o[i] = (T)((U)o[i] + (U)x[i]);                                          \
            }                                                                               \
            if (avg) {                                                                      \
                const T d = (T)w;                                                           \
                for (Py_ssize_t i = 0; i < m; i++)                                          \
                    o[i] = o[i] / d;                                                        \
            }                                                                               \
        }                                                                                   \
    }

KERNEL(sum_f32, float, float)
KERNEL(sum_f64, double, double)
KERNEL(sum_i32, int32_t, uint32_t) /* wraps, as numpy's int32 */
KERNEL(sum_i64, int64_t, uint64_t)

typedef void (*kernel_fn)(char *, char *const *, Py_ssize_t, Py_ssize_t, int);

/* The kernel for a buffer's format and item size, or NULL (numpy's turn): SUM of
   float32/float64/int32/int64, AVG of the floats. */
static kernel_fn kernel_for(const Py_buffer *view, int avg) {
    const char *f = view->format ? view->format : "B";
    while (*f == '<' || *f == '=' || *f == '@')
        f++;
    char kind = (f[0] && !f[1]) ? f[0] : 0;
    if (kind == 'f' && view->itemsize == 4)
        return sum_f32;
    if (kind == 'd' && view->itemsize == 8)
        return sum_f64;
    if (avg || !(kind == 'i' || kind == 'l' || kind == 'q'))
        return NULL;
    if (view->itemsize == 4)
        return sum_i32;
    if (view->itemsize == 8)
        return sum_i64;
    return NULL;
}

static int overlaps(const char *a, Py_ssize_t alen, const char *b, Py_ssize_t blen) {
    return a < b + blen && b < a + alen;
}

/* reduce(parity, out, reduce_op) -> True once out holds the reduction, in rank order, of
   every rank's first out.nbytes bytes of buffer parity; False (out untouched) for what is
   left to numpy: dtypes other than float32/float64/int32/int64, ops other than SUM (and AVG
   of floats), a world of one */
static PyObject *Slot_reduce(Slot *self, PyObject *const *args, Py_ssize_t nargs) {
    REQUIRE_REGION(self);
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "reduce() takes 3 arguments");
        return NULL;
    }
    long parity = PyLong_AsLong(args[0]);
    long op = PyLong_AsLong(args[2]);
    if (PyErr_Occurred())
        return NULL;
    parity &= 1;
    if (self->world < 2 || self->world > MAX_INPUTS ||
        (op != self->sum_op && op != self->avg_op))
        Py_RETURN_FALSE;
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) <
        0) {
        PyErr_Clear(); /* no buffer of it (bfloat16), or read-only: numpy's turn */
        Py_RETURN_FALSE;
    }
    kernel_fn kernel = kernel_for(&view, op == self->avg_op);
    char *ins[MAX_INPUTS];
    int ok = kernel != NULL && view.len <= self->data_bytes;
    for (Py_ssize_t r = 0; ok && r < self->world; r++) {
        ins[r] = data(self, r, parity);
        ok = !overlaps(view.buf, view.len, ins[r], view.len);
    }
    if (ok)
        kernel(view.buf, ins, self->world, view.itemsize ? view.len / view.itemsize : 0,
               op == self->avg_op);
    PyBuffer_Release(&view);
    if (ok)
        Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

/* reduce_into(out, ins, average) -> True once out holds the reduction of the buffers ins in
   their order (their sum; divided by len(ins) when average), without the GIL; False (out
   untouched) for what is left to numpy: buffers that are not C-contiguous or differ in
   format or length, out overlapping an input, dtypes other than float32/float64/int32/int64,
   averages of integers, fewer than 2 or more than MAX_INPUTS inputs. */
static PyObject *reduce_into(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "reduce_into() takes 3 arguments");
        return NULL;
    }
    int avg = PyObject_IsTrue(args[2]);
    if (avg < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[1], "reduce_into(): ins must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t w = PySequence_Fast_GET_SIZE(seq);
    Py_buffer out, ins[MAX_INPUTS];
    Py_ssize_t held = 0;
    int ok = w >= 2 && w <= MAX_INPUTS &&
             PyObject_GetBuffer(args[0], &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE |
                                                    PyBUF_FORMAT) == 0;
    int have_out = ok;
    kernel_fn kernel = ok ? kernel_for(&out, avg) : NULL;
    ok = kernel != NULL;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (; ok && held < w; held++) {
        if (PyObject_GetBuffer(items[held], &ins[held], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            ok = 0;
            break;
        }
        const char *fo = out.format ? out.format : "B", *fi = ins[held].format ? ins[held].format : "B";
        ok = ins[held].len == out.len && ins[held].itemsize == out.itemsize &&
             strcmp(fo, fi) == 0 && !overlaps(out.buf, out.len, ins[held].buf, ins[held].len);
    }
    PyErr_Clear(); /* a buffer refused: numpy's turn */
    if (ok) {
        char *ptrs[MAX_INPUTS];
        for (Py_ssize_t r = 0; r < w; r++)
            ptrs[r] = ins[r].buf;
        Py_ssize_t n = out.itemsize ? out.len / out.itemsize : 0;
        Py_BEGIN_ALLOW_THREADS kernel(out.buf, ptrs, w, n, avg);
        Py_END_ALLOW_THREADS
    }
    for (Py_ssize_t r = 0; r < held; r++)
        PyBuffer_Release(&ins[r]);
    if (have_out)
        PyBuffer_Release(&out);
    Py_DECREF(seq);
    if (ok)
        Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

static void Slot_dealloc(Slot *self) {
    release_region(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Slot_get_step(Slot *self, void *closure) {
    REQUIRE_REGION(self);
    return PyLong_FromLongLong(self->step);
}

static PyMethodDef Slot_methods[] = {
    {"bump", (PyCFunction)Slot_bump, METH_NOARGS, "Arrives at the next point; its number."},
    {"publish", (PyCFunction)(void (*)(void))Slot_publish, METH_FASTCALL,
     "publish(seq, parity, kind, dtype, count, root, reduce_op) -> step"},
    {"spin", (PyCFunction)Slot_spin, METH_O, "spin(target) -> 1 arrived, 0 not yet, -1 alarm"},
    {"agree", (PyCFunction)(void (*)(void))Slot_agree, METH_FASTCALL,
     "agree(seq, parity) -> whether every rank published the same signature"},
    {"done", (PyCFunction)(void (*)(void))Slot_done, METH_FASTCALL,
     "done(seq, parity, kind, dtype, nbytes): counts the completed op"},
    {"fill", (PyCFunction)(void (*)(void))Slot_fill, METH_FASTCALL,
     "fill(parity, array) -> whether it copied the array into this rank's buffer"},
    {"reduce", (PyCFunction)(void (*)(void))Slot_reduce, METH_FASTCALL,
     "reduce(parity, out, reduce_op) -> whether it reduced (False: numpy's turn)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Slot_getset[] = {
    {"step", (getter)Slot_get_step, NULL, "this rank's step counter", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject SlotType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "smddp.core._fastregion.Slot",
    .tp_doc = "Slot(region, rank, world, slot_bytes, data_bytes, spin_ns, layout, bounds_ns, "
              "sum_op, avg_op): a rank's side of a mapped control region (a writable buffer, "
              "which the Slot holds for its lifetime; the layout is checked to fit it).",
    .tp_basicsize = sizeof(Slot),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Slot_init,
    .tp_dealloc = (destructor)Slot_dealloc,
    .tp_methods = Slot_methods,
    .tp_getset = Slot_getset,
};

static PyMethodDef module_methods[] = {
    {"reduce_into", (PyCFunction)(void (*)(void))reduce_into, METH_FASTCALL,
     "reduce_into(out, ins, average) -> True once out holds the rank-order reduction of ins"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "smddp.core._fastregion",
    "The region path's per-op bookkeeping in C (see client/shm.py).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__fastregion(void) {
    if (PyType_Ready(&SlotType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    PyObject *names = PyTuple_New(L_COUNT);
    if (names == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < L_COUNT; i++) {
        PyObject *s = PyUnicode_FromString(LAYOUT[i]);
        if (s == NULL) {
            Py_DECREF(names);
            goto fail;
        }
        PyTuple_SET_ITEM(names, i, s);
    }
    if (PyModule_AddObject(m, "LAYOUT", names) < 0) {
        Py_DECREF(names);
        goto fail;
    }
    Py_INCREF(&SlotType);
    if (PyModule_AddObject(m, "Slot", (PyObject *)&SlotType) < 0) {
        Py_DECREF(&SlotType);
        goto fail;
    }
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
