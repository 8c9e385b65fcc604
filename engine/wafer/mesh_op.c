/* spark.wafer::MeshLinear — one mesh line's worth of GEMVs and their reduction as one ONNX Runtime op.
 *
 *   y[..., N] = MeshLinear(x[..., K], W_0[k_0, N], ..., W_{L-1}[k_{L-1}, N]),  sum k_p = K
 *
 * W_p holds the tiles of mesh line p (PE (p, j)'s tile is column block j, side by side; see
 * engine/wafer/partition.py).  Line p takes its slice x[..., k-block p], multiplies it by its tiles
 * and adds the partial products to the running sum arriving from line p-1: the systolic chain
 * reduction of MeshGEMV, the same arithmetic as the graph's Split -> MatMul -> Gemm(C = partial)
 * chain, in one kernel launch instead of 2L+1 ONNX nodes (on a small model the per-node cost of
 * ONNX Runtime, not the arithmetic, is what partitioning costs).
 *
 * Each line's tiles are packed once, when the session loads, into 64-column panels stored row
 * after row, so a GEMV streams every panel front to back (what MLAS's pre-packing does for its
 * own MatMul); panels are cut into tasks run on ONNX Runtime's intra-op thread pool, and token
 * rows go through in blocks of six (prefill, speculative verification) or one (decode).
 *
 * No ONNX Runtime header is needed: the C API is an append-only table of function pointers
 * whose slots never move, so the few entries used are called by slot number (below).  Built on
 * first use by engine/wafer/mesh_op.py with the system C compiler.
 */
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the slice of the ONNX Runtime C API this op uses (slots of struct OrtApi) ---- */

typedef struct OrtStatus OrtStatus;
typedef struct OrtValue OrtValue;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;
typedef void* const* OrtApiTable;

typedef struct OrtApiBase {
  OrtApiTable (*GetApi)(uint32_t version);
  const char* (*GetVersionString)(void);
} OrtApiBase;

enum { ORT_OK = 0, ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };
enum { ELEM_FLOAT = 1 };
enum { CHAR_REQUIRED = 0, CHAR_OPTIONAL = 1, CHAR_VARIADIC = 2 };

/* API version whose table holds every slot below (ONNX Runtime 1.20, this project's minimum). */
#define API_VERSION 20
#define SLOT_CreateStatus 0
#define SLOT_CreateCustomOpDomain 26
#define SLOT_CustomOpDomain_Add 27
#define SLOT_AddCustomOpDomain 28
#define SLOT_GetTensorMutableData 51
#define SLOT_GetTensorElementType 60
#define SLOT_GetDimensionsCount 61
#define SLOT_GetDimensions 62
#define SLOT_GetTensorTypeAndShape 65
#define SLOT_KernelContext_GetInputCount 88
#define SLOT_KernelContext_GetInput 90
#define SLOT_KernelContext_GetOutput 91
#define SLOT_ReleaseStatus 93
#define SLOT_ReleaseTensorTypeAndShapeInfo 99
#define SLOT_KernelInfo_GetInputCount 230
#define SLOT_KernelInfoGetConstantInput_tensor 249
#define SLOT_KernelContext_ParallelFor 274

static OrtApiTable api;
#define CALL(slot, type) ((type)api[SLOT_##slot])

typedef OrtStatus* (*CreateStatusFn)(int code, const char* msg);
typedef OrtStatus* (*CreateCustomOpDomainFn)(const char* domain, OrtCustomOpDomain** out);
typedef OrtStatus* (*CustomOpDomainAddFn)(OrtCustomOpDomain* domain, const void* op);
typedef OrtStatus* (*AddCustomOpDomainFn)(OrtSessionOptions* options, OrtCustomOpDomain* domain);
typedef OrtStatus* (*GetTensorMutableDataFn)(OrtValue* value, void** out);
typedef OrtStatus* (*GetTensorElementTypeFn)(const OrtTensorTypeAndShapeInfo* info, int* out);
typedef OrtStatus* (*GetDimensionsCountFn)(const OrtTensorTypeAndShapeInfo* info, size_t* out);
typedef OrtStatus* (*GetDimensionsFn)(const OrtTensorTypeAndShapeInfo* info, int64_t* dims, size_t n);
typedef OrtStatus* (*GetTensorTypeAndShapeFn)(const OrtValue* value, OrtTensorTypeAndShapeInfo** out);
typedef OrtStatus* (*GetInputCountFn)(const OrtKernelContext* ctx, size_t* out);
typedef OrtStatus* (*GetInputFn)(const OrtKernelContext* ctx, size_t index, const OrtValue** out);
typedef OrtStatus* (*GetOutputFn)(OrtKernelContext* ctx, size_t index, const int64_t* dims, size_t n, OrtValue** out);
typedef void (*ReleaseStatusFn)(OrtStatus* status);
typedef void (*ReleaseShapeFn)(OrtTensorTypeAndShapeInfo* info);
typedef OrtStatus* (*KernelInfoGetInputCountFn)(const OrtKernelInfo* info, size_t* out);
typedef OrtStatus* (*GetConstantInputFn)(const OrtKernelInfo* info, size_t index, int* is_constant,
                                         const OrtValue** out);
typedef OrtStatus* (*ParallelForFn)(const OrtKernelContext* ctx, void (*fn)(void*, size_t), size_t total,
                                    size_t num_batch, void* usr_data);

/* OrtCustomOp as laid out since API 16 (version, then 25 function pointers; unused ones NULL). */
typedef struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const struct OrtCustomOp*, OrtApiTable, const OrtKernelInfo*);
  const char* (*GetName)(const struct OrtCustomOp*);
  const char* (*GetExecutionProviderType)(const struct OrtCustomOp*);
  int (*GetInputType)(const struct OrtCustomOp*, size_t index);
  size_t (*GetInputTypeCount)(const struct OrtCustomOp*);
  int (*GetOutputType)(const struct OrtCustomOp*, size_t index);
  size_t (*GetOutputTypeCount)(const struct OrtCustomOp*);
  void (*KernelCompute)(void* kernel, OrtKernelContext* ctx);
  void (*KernelDestroy)(void* kernel);
  int (*GetInputCharacteristic)(const struct OrtCustomOp*, size_t index);
  int (*GetOutputCharacteristic)(const struct OrtCustomOp*, size_t index);
  int (*GetInputMemoryType)(const struct OrtCustomOp*, size_t index);
  int (*GetVariadicInputMinArity)(const struct OrtCustomOp*);
  int (*GetVariadicInputHomogeneity)(const struct OrtCustomOp*);
  int (*GetVariadicOutputMinArity)(const struct OrtCustomOp*);
  int (*GetVariadicOutputHomogeneity)(const struct OrtCustomOp*);
  OrtStatus* (*CreateKernelV2)(const struct OrtCustomOp*, OrtApiTable, const OrtKernelInfo*, void** kernel);
  OrtStatus* (*KernelComputeV2)(void* kernel, OrtKernelContext* ctx);
  void* InferOutputShapeFn;
  void* GetStartVersion;
  void* GetEndVersion;
  void* GetMayInplace;
  void* ReleaseMayInplace;
  void* GetAliasMap;
  void* ReleaseAliasMap;
} OrtCustomOp;

/* ---- the kernel ---- */

typedef float v16 __attribute__((vector_size(64), aligned(4)));
static inline v16 ld(const float* p) { return *(const v16*)p; }
static inline void st(float* p, v16 v) { *(v16*)p = v; }
static inline v16 bc(float s) { return (v16){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }

#define MAX_LINES 256
#define NR 64 /* columns per panel: four 16-float vectors */
#ifndef MAXR
#define MAXR 6
#endif

/* One mesh line's tiles, packed once when the session loads: panel q holds columns
   [q*NR, q*NR+NR) of every row, rows contiguous ([panels][rows][NR], zero-padded past N), so a
   GEMV streams each panel front to back. */
typedef struct {
  size_t lines, K, N, panels;
  size_t rows[MAX_LINES];
  float* packed[MAX_LINES];
} Tiles;

typedef struct {
  const Tiles* t;
  const float* x; /* [M, K] */
  float* y;       /* [M, N] */
  size_t M, panels_per_task;
} Job;

static void pack_line(const float* w, size_t rows, size_t N, size_t panels, float* out) {
  for (size_t q = 0; q < panels; q++)
    for (size_t k = 0; k < rows; k++) {
      float* dst = out + (q * rows + k) * NR;
      const size_t n0 = q * NR, nc = N - n0 < NR ? N - n0 : NR;
      memcpy(dst, w + k * N + n0, nc * sizeof(float));
      memset(dst + nc, 0, (NR - nc) * sizeof(float));
    }
}

/* Write (first line) or add (every next line: the partial sum arriving from the previous line)
   MR rows of 64 partial products into y, of which only nc columns exist. */
static inline __attribute__((always_inline)) void reduce_into(float* y, size_t ldy, size_t nc, int first,
                                                              v16 part[][4], const int MR) {
  for (int r = 0; r < MR; r++) {
    float* yr = y + r * ldy;
    if (nc == NR) {
      for (int c = 0; c < 4; c++) st(yr + 16 * c, first ? part[r][c] : ld(yr + 16 * c) + part[r][c]);
    } else {
      float tmp[NR];
      for (int c = 0; c < 4; c++) st(tmp + 16 * c, part[r][c]);
      for (size_t c = 0; c < nc; c++) yr[c] = first ? tmp[c] : yr[c] + tmp[c];
    }
  }
}

/* Rows [0, MR) of panel q: each mesh line computes its partial products x[:, its k-block] @ its
   tiles in registers, then reduces them into y along the line (chain order, as the graph form). */
static inline __attribute__((always_inline)) void panel(const Job* j, const float* x, float* y, size_t q,
                                                        const int MR) {
  const Tiles* t = j->t;
  const size_t n0 = q * NR, nc = t->N - n0 < NR ? t->N - n0 : NR;
  size_t koff = 0;
  for (size_t p = 0; p < t->lines; p++) {
    const size_t rows = t->rows[p];
    const float* w = t->packed[p] + q * rows * NR;
    v16 part[MAXR][4], odd[4];
    for (int r = 0; r < MR; r++)
      for (int c = 0; c < 4; c++) part[r][c] = bc(0);
    for (int c = 0; c < 4; c++) odd[c] = bc(0);
    size_t k = 0;
    if (MR == 1) /* two rows of weights per step: eight independent accumulators hide FMA latency */
      for (; k + 2 <= rows; k += 2, w += 2 * NR) {
        const v16 x0 = bc(x[koff + k]), x1 = bc(x[koff + k + 1]);
        for (int c = 0; c < 4; c++) {
          part[0][c] += x0 * ld(w + 16 * c);
          odd[c] += x1 * ld(w + NR + 16 * c);
        }
      }
    for (; k < rows; k++, w += NR) {
      const v16 w0 = ld(w), w1 = ld(w + 16), w2 = ld(w + 32), w3 = ld(w + 48);
      for (int r = 0; r < MR; r++) {
        const v16 xv = bc(x[r * t->K + koff + k]);
        part[r][0] += xv * w0; part[r][1] += xv * w1; part[r][2] += xv * w2; part[r][3] += xv * w3;
      }
    }
    if (MR == 1)
      for (int c = 0; c < 4; c++) part[0][c] += odd[c];
    reduce_into(y + n0, t->N, nc, p == 0, part, MR);
    koff += rows;
  }
}

/* One task: a run of panels (output columns) for every token row. */
static void task(void* data, size_t i) {
  const Job* j = (const Job*)data;
  const size_t q0 = i * j->panels_per_task;
  const size_t q1 = q0 + j->panels_per_task < j->t->panels ? q0 + j->panels_per_task : j->t->panels;
  const size_t K = j->t->K, N = j->t->N;
  for (size_t q = q0; q < q1; q++) {
    size_t m = 0;
    for (; m + MAXR <= j->M; m += MAXR) panel(j, j->x + m * K, j->y + m * N, q, MAXR);
    for (; m + 4 <= j->M; m += 4) panel(j, j->x + m * K, j->y + m * N, q, 4);
    for (; m < j->M; m++) panel(j, j->x + m * K, j->y + m * N, q, 1);
  }
}

/* ---- ONNX Runtime glue ---- */

static OrtStatus* error(const char* fmt, ...) {
  char msg[256];
  va_list args;
  va_start(args, fmt);
  vsnprintf(msg, sizeof msg, fmt, args);
  va_end(args);
  return CALL(CreateStatus, CreateStatusFn)(ORT_INVALID_ARGUMENT, msg);
}

#define TRY(expr)                       \
  do {                                  \
    OrtStatus* _s = (expr);             \
    if (_s) return _s;                  \
  } while (0)

/* Element type, rank and dimensions (up to 8) of a tensor. */
static OrtStatus* shape_of(const OrtValue* v, int* type, size_t* rank, int64_t dims[8]) {
  OrtTensorTypeAndShapeInfo* info = NULL;
  TRY(CALL(GetTensorTypeAndShape, GetTensorTypeAndShapeFn)(v, &info));
  OrtStatus* s = CALL(GetTensorElementType, GetTensorElementTypeFn)(info, type);
  if (!s) s = CALL(GetDimensionsCount, GetDimensionsCountFn)(info, rank);
  if (!s && *rank > 8) s = error("MeshLinear: rank %zu tensors are not supported", *rank);
  if (!s) s = CALL(GetDimensions, GetDimensionsFn)(info, dims, *rank);
  CALL(ReleaseTensorTypeAndShapeInfo, ReleaseShapeFn)(info);
  return s;
}

/* x and 1..MAX_LINES lines of tiles: the inputs a MeshLinear node must have. */
static OrtStatus* check_input_count(size_t n_in) {
  if (n_in < 2 || n_in - 1 > MAX_LINES)
    return error("MeshLinear: expected x and 1 to %d mesh lines of tiles, got %zu inputs", MAX_LINES, n_in);
  return NULL;
}

/* Check the lines' tiles (2-D float, same column count) and pack them into t. */
static OrtStatus* pack_tiles(const OrtValue* const* vals, size_t lines, Tiles* t) {
  int type = 0;
  size_t rank = 0;
  int64_t d[8];
  memset(t, 0, sizeof *t);
  t->lines = lines;
  for (size_t p = 0; p < lines; p++) {
    TRY(shape_of(vals[p], &type, &rank, d));
    if (type != ELEM_FLOAT || rank != 2) return error("MeshLinear: line %zu's tiles must be a 2-D float tensor", p);
    if (p == 0) t->N = (size_t)d[1];
    if ((size_t)d[1] != t->N) return error("MeshLinear: line %zu has %zu output columns, line 0 has %zu", p, (size_t)d[1], t->N);
    t->rows[p] = (size_t)d[0];
    t->K += t->rows[p];
  }
  t->panels = (t->N + NR - 1) / NR;
  for (size_t p = 0; p < lines; p++) {
    const float* w = NULL;
    TRY(CALL(GetTensorMutableData, GetTensorMutableDataFn)((OrtValue*)vals[p], (void**)&w));
    const size_t bytes = t->panels * t->rows[p] * NR * sizeof(float);
    if (posix_memalign((void**)&t->packed[p], 64, bytes ? bytes : 64))
      return CALL(CreateStatus, CreateStatusFn)(ORT_FAIL, "MeshLinear: out of memory packing the tiles");
    pack_line(w, t->rows[p], t->N, t->panels, t->packed[p]);
  }
  return NULL;
}

static void free_tiles(Tiles* t) {
  for (size_t p = 0; p < t->lines; p++) free(t->packed[p]);
  memset(t, 0, sizeof *t);
}

typedef struct {
  Tiles tiles; /* packed at load time when every line's tiles are constant initializers, else empty */
} Kernel;

static OrtStatus* run(const Tiles* t, OrtKernelContext* ctx, const OrtValue* xv) {
  int type = 0;
  size_t rank = 0;
  int64_t dims[8];
  Job j = {.t = t};
  TRY(shape_of(xv, &type, &rank, dims));
  if (type != ELEM_FLOAT || rank < 1) return error("MeshLinear: x must be a float tensor of rank >= 1");
  if ((size_t)dims[rank - 1] != t->K)
    return error("MeshLinear: x has %zu features but the lines' tiles have %zu rows in all", (size_t)dims[rank - 1], t->K);
  TRY(CALL(GetTensorMutableData, GetTensorMutableDataFn)((OrtValue*)xv, (void**)&j.x));
  j.M = 1;
  for (size_t i = 0; i + 1 < rank; i++) j.M *= (size_t)dims[i];
  dims[rank - 1] = (int64_t)t->N;
  OrtValue* out = NULL;
  TRY(CALL(KernelContext_GetOutput, GetOutputFn)(ctx, 0, dims, rank, &out));
  TRY(CALL(GetTensorMutableData, GetTensorMutableDataFn)(out, (void**)&j.y));
  if (j.M == 0 || t->N == 0) return NULL;
  if (t->K == 0) {
    memset(j.y, 0, j.M * t->N * sizeof(float));
    return NULL;
  }
  /* Tasks of >= ~64K multiply-adds (MLAS's own threading grain), in whole panels. */
  size_t tasks = (size_t)((double)j.M * (double)t->N * (double)t->K / 65536.0);
  if (tasks < 1) tasks = 1;
  if (tasks > t->panels) tasks = t->panels;
  j.panels_per_task = (t->panels + tasks - 1) / tasks;
  tasks = (t->panels + j.panels_per_task - 1) / j.panels_per_task;
  if (tasks == 1) {
    task(&j, 0);
    return NULL;
  }
  return CALL(KernelContext_ParallelFor, ParallelForFn)(ctx, task, tasks, 0, &j);
}

static OrtStatus* compute(void* kernel, OrtKernelContext* ctx) {
  Kernel* k = (Kernel*)kernel;
  size_t n_in = 0;
  const OrtValue* x = NULL;
  TRY(CALL(KernelContext_GetInputCount, GetInputCountFn)(ctx, &n_in));
  TRY(CALL(KernelContext_GetInput, GetInputFn)(ctx, 0, &x));
  if (k->tiles.lines) return run(&k->tiles, ctx, x);
  /* Tiles fed at run time (not initializers): pack them for this call only. */
  const OrtValue* vals[MAX_LINES];
  TRY(check_input_count(n_in));
  for (size_t p = 0; p + 1 < n_in; p++) TRY(CALL(KernelContext_GetInput, GetInputFn)(ctx, p + 1, &vals[p]));
  Tiles t;
  OrtStatus* s = pack_tiles(vals, n_in - 1, &t);
  if (!s) s = run(&t, ctx, x);
  free_tiles(&t);
  return s;
}

static OrtStatus* create_kernel(const OrtCustomOp* op, OrtApiTable a, const OrtKernelInfo* info, void** out) {
  (void)op; (void)a;
  size_t n_in = 0;
  TRY(CALL(KernelInfo_GetInputCount, KernelInfoGetInputCountFn)(info, &n_in));
  TRY(check_input_count(n_in));
  Kernel* k = calloc(1, sizeof *k);
  if (!k) return CALL(CreateStatus, CreateStatusFn)(ORT_FAIL, "MeshLinear: out of memory");
  const OrtValue* vals[MAX_LINES];
  int all_constant = 1;
  for (size_t p = 0; p + 1 < n_in && all_constant; p++) {
    int is_const = 0;
    OrtStatus* s = CALL(KernelInfoGetConstantInput_tensor, GetConstantInputFn)(info, p + 1, &is_const, &vals[p]);
    if (s) {
      free(k);
      return s;
    }
    all_constant = is_const && vals[p];
  }
  if (all_constant) {
    OrtStatus* s = pack_tiles(vals, n_in - 1, &k->tiles);
    if (s) {
      free_tiles(&k->tiles);
      free(k);
      return s;
    }
  }
  *out = k;
  return NULL;
}

static void destroy_kernel(void* kernel) {
  Kernel* k = (Kernel*)kernel;
  free_tiles(&k->tiles);
  free(k);
}

static const char* op_name(const OrtCustomOp* op) { (void)op; return "MeshLinear"; }
static const char* op_provider(const OrtCustomOp* op) { (void)op; return "CPUExecutionProvider"; }
static int float_type(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return ELEM_FLOAT; }
static size_t two(const OrtCustomOp* op) { (void)op; return 2; }
static size_t one(const OrtCustomOp* op) { (void)op; return 1; }
static int input_char(const OrtCustomOp* op, size_t i) { (void)op; return i == 0 ? CHAR_REQUIRED : CHAR_VARIADIC; }
static int output_char(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return CHAR_REQUIRED; }
static int mem_default(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return 0; }
static int min_arity(const OrtCustomOp* op) { (void)op; return 1; }
static int homogeneous(const OrtCustomOp* op) { (void)op; return 1; }

static const OrtCustomOp mesh_linear = {
    .version = API_VERSION,
    .GetName = op_name,
    .GetExecutionProviderType = op_provider,
    .GetInputType = float_type,
    .GetInputTypeCount = two,
    .GetOutputType = float_type,
    .GetOutputTypeCount = one,
    .KernelDestroy = destroy_kernel,
    .GetInputCharacteristic = input_char,
    .GetOutputCharacteristic = output_char,
    .GetInputMemoryType = mem_default,
    .GetVariadicInputMinArity = min_arity,
    .GetVariadicInputHomogeneity = homogeneous,
    .GetVariadicOutputMinArity = min_arity,
    .GetVariadicOutputHomogeneity = homogeneous,
    .CreateKernelV2 = create_kernel,
    .KernelComputeV2 = compute,
};

/* One domain for the process (it must outlive every session that uses it), made once even when
   sessions are created on several threads. */
static OrtCustomOpDomain* domain;
static OrtStatus* domain_error;
static const OrtApiBase* api_base;
static pthread_once_t domain_once = PTHREAD_ONCE_INIT;

static void make_domain(void) {
  api = api_base->GetApi(API_VERSION);
  if (!api) return;
  domain_error = CALL(CreateCustomOpDomain, CreateCustomOpDomainFn)("spark.wafer", &domain);
  if (!domain_error) domain_error = CALL(CustomOpDomain_Add, CustomOpDomainAddFn)(domain, &mesh_linear);
}

__attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                   const OrtApiBase* base) {
  api_base = base;
  pthread_once(&domain_once, make_domain);
  if (!api) return NULL; /* older than 1.20: mesh_op.py never loads it there */
  if (domain_error) return CALL(CreateStatus, CreateStatusFn)(ORT_FAIL, "MeshLinear: could not register spark.wafer");
  return CALL(AddCustomOpDomain, AddCustomOpDomainFn)(options, domain);
}
