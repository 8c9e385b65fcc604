/* spark.wafer::MeshLinear — one mesh line's worth of GEMVs and their reduction as one ONNX Runtime op.
 *
 *   y[..., N] = MeshLinear(x[..., K], shape, W_0, ..., W_{L-1} [, bias])   attribute transposed (0 or 1)
 *   optional attributes: glu (the gated-MLP epilogue: y = act(gate) * up, see "the gated-MLP
 *   epilogue" below), norm and epsilon (an RMSNorm of x first, with a skip input and the sum as a
 *   second output: inputs (x, [skip,] gamma, shape, ...), see "the RMSNorm prologue" below)
 *
 * shape: int64 [L+1] = (N, k_0, ..., k_{L-1}), the output columns and each mesh line's K extent
 * (sum k_p = K).  Line p takes its slice x[..., k-block p], multiplies it by its tiles and adds the
 * partial products to the running sum arriving from line p-1: the systolic chain reduction of
 * MeshGEMV, the same arithmetic as the graph's Split -> MatMul -> Gemm(C = partial) chain, in one
 * kernel launch instead of 2L+1 ONNX nodes (on a small model the per-node cost of ONNX Runtime,
 * not the arithmetic, is what partitioning costs).
 *
 * The weights are stored in the layout the kernel streams, so the initializers are used in place
 * (no packed copy when the session loads; the layout is decided when the graph is written):
 *   transposed=0: W_p float [panels, k_p, 64] — line p's tiles (PE (p, j)'s tile is column block
 *                 j, side by side; see engine/wafer/partition.py) cut into 64-column panels, panel
 *                 q holding columns [64q, 64q + 64) of every row, rows contiguous, zero-padded
 *                 past N; a GEMV streams each panel front to back (engine/wafer/mesh_op.py:
 *                 pack_float writes it);
 *   transposed=1: one input W float [N, K], row n holding output column n's weights; line p reads
 *                 columns [k_0 + ... + k_{p-1}, + k_p) of every row.  A tied LM head reads the
 *                 token embedding table this way, so the graph holds that table once.
 * bias (optional) float [N] is added after the last line's reduction (what an Add node after the op
 * would compute, without the node).
 * Panels (or runs of rows) are cut into tasks run on ONNX Runtime's intra-op thread pool, and
 * token rows go through in blocks of six or four (prefill, speculative verification) or one at a
 * time over two panels (decode); every row's sums run in the same order either way.
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
#include <strings.h>

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

#if defined(__AVX512F__) || defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64), aligned(4)));
static inline v16 ld(const float* p) { return *(const v16*)p; }
static inline void st(float* p, v16 v) { *(v16*)p = v; }
static inline v16 bc(float s) { return (v16){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }
static inline float hsum(v16 v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#else
  float s = 0.0f;
  for (int i = 0; i < 16; i++) s += v[i];
  return s;
#endif
}

#define MAX_LINES 256
#define NR 64 /* columns per panel: four 16-float vectors */
#ifndef MAXR
#define MAXR 6
#endif
#define TMAXR 4 /* token rows per pass over a transposed weight */

#define SLOT_KernelInfoGetAttribute_int64 86
typedef OrtStatus* (*GetAttrInt64Fn)(const OrtKernelInfo* info, const char* name, int64_t* out);
enum { ELEM_UINT8 = 2, ELEM_INT64 = 7, ELEM_FLOAT16 = 10 };

/* Every line's weights, in place (pointers into the inputs). */
typedef struct {
  int transposed;
  size_t lines, K, N, panels;
  size_t rows[MAX_LINES];
  const float* w[MAX_LINES]; /* transposed: w[0] is the [N, K] table */
  const float* bias;         /* [N], added after the last line's reduction; NULL: none */
  int glu;                   /* GLU_*: the gated-MLP epilogue (N then counts the gate|up panel columns) */
  size_t out_n;              /* output columns: N, or with glu the F gated columns */
} Tiles;

typedef struct {
  const Tiles* t;
  const float* x; /* [M, K] */
  float* y;       /* [M, N]; with glu a scratch buffer the epilogue reads */
  size_t M, per_task; /* panels (or, transposed, output columns) per task */
  float* out;                      /* glu: the op's output [M, out_n]; NULL: y is the output */
  void (*inner)(void*, size_t);    /* glu: the task that fills y before the epilogue */
} Job;

/* ---- the gated-MLP epilogue (attribute glu) ----
 *
 * A gated MLP's gate_up linear is followed by act(gate) * up.  With glu != 0 the op computes that
 * itself, so a decode step runs one node where the graph had four (linear, Split, activation, Mul).
 * The weight's columns are stored interleaved by panel: panel q holds gate columns [32q, 32q + 32)
 * in its first 32 columns and the matching up columns in its last 32 (zero-padded past F; see
 * engine/wafer/mesh_op.py: glu_columns), so a panel's reduction (and bias) finishes both halves of
 * its 32 outputs.  shape[0] is then F, the output columns; the weights (and the bias, in the same
 * column order) hold 64 * ceil(F / 32) columns.  The panels' sums go to a scratch buffer and the
 * epilogue runs once per panel, at the end of the task that computed it (the panel loops are
 * unchanged):
 *     out[m, 32q + c] = act(y[m, 64q + c]) * y[m, 64q + 32 + c]
 * act: GLU_SILU x * sigmoid(x); GLU_GELU_TANH 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))),
 * computed as x * sigmoid(2u), which has no cancellation for large negative x.  The sigmoid uses a
 * Cephes-style exp (relative error ~1e-7, no libm), so the result matches ORT's Sigmoid/QuickGelu
 * and FastGelu to float rounding.
 */
enum { GLU_NONE = 0, GLU_SILU = 1, GLU_GELU_TANH = 2 };
#define GLU_HALF (NR / 2) /* gated output columns per panel */

/* exp(x) for x clamped to [-87, 88] (beyond, sigmoid is 0 or 1 to float precision anyway):
   2^n * p(r), r = x - n ln 2, the Cephes polynomial; branch-free, so the caller's loop vectorises. */
static inline float glu_exp(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
  const float n = (x * 1.44269504088896341f + magic) - magic;
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

/* Panel q's gated outputs for rows [0, M): y [M, ldy] holds the panel's gate|up sums at columns
   [64q, 64q + 64); out [M, out_n] gets columns [32q, 32q + 32) that exist. */
static void glu_panel(int glu, const float* y, size_t ldy, float* out, size_t out_n, size_t M, size_t q) {
  const size_t c0 = q * GLU_HALF, nc = out_n - c0 < GLU_HALF ? out_n - c0 : GLU_HALF;
  for (size_t m = 0; m < M; m++) {
    const float* g = y + m * ldy + q * NR;
    float* o = out + m * out_n + c0;
    float v[GLU_HALF];
    if (glu == GLU_SILU)
      for (int c = 0; c < GLU_HALF; c++) v[c] = g[c] / (1.0f + glu_exp(-g[c])) * g[GLU_HALF + c];
    else
      for (int c = 0; c < GLU_HALF; c++) {
        const float x = g[c], z = 1.5957691216057308f * (x + 0.044715f * x * x * x);
        v[c] = x / (1.0f + glu_exp(-z)) * g[GLU_HALF + c];
      }
    memcpy(o, v, nc * sizeof(float));
  }
}

/* The packed columns a gated linear of out_n outputs stores: whole panels of gate|up halves. */
static inline size_t glu_columns(size_t out_n) { return (out_n + GLU_HALF - 1) / GLU_HALF * NR; }

/* y[c] = (first ? v[c] : y[c] + v[c]) (+ b[c] where there is a bias b): one step of the chain
   reduction and, on the last line, the bias.  The four cases are four loops: written as one loop
   with `b ? ... : ...` inside, compilers vectorise it with masked loads of b, which read from NULL
   where there is no bias, and AMD's cores (Zen 4, Zen 5) run such a load, every lane masked off on
   an unmapped page, as a slow microcode assist, once per row, line and panel (docs/wafer.md). */
static inline void add_row(float* restrict y, const float* restrict v, size_t nc, int first,
                           const float* restrict b) {
  if (first && b)
    for (size_t c = 0; c < nc; c++) y[c] = v[c] + b[c];
  else if (first)
    for (size_t c = 0; c < nc; c++) y[c] = v[c];
  else if (b)
    for (size_t c = 0; c < nc; c++) y[c] = (y[c] + v[c]) + b[c];
  else
    for (size_t c = 0; c < nc; c++) y[c] = y[c] + v[c];
}

/* Write (first line) or add (every next line: the partial sum arriving from the previous line)
   MR rows of 64 partial products into y, of which only nc columns exist; after the last line,
   add the bias b (if any), as an Add node after the op would. */
static inline __attribute__((always_inline)) void reduce_into(float* y, size_t ldy, size_t nc, int first,
                                                              const float* b, v16 part[][4], const int MR) {
  for (int r = 0; r < MR; r++) {
    float* yr = y + r * ldy;
    if (nc == NR) {
      for (int c = 0; c < 4; c++) {
        v16 v = first ? part[r][c] : ld(yr + 16 * c) + part[r][c];
        if (b) v += ld(b + 16 * c);
        st(yr + 16 * c, v);
      }
    } else {
      float tmp[NR];
      for (int c = 0; c < 4; c++) st(tmp + 16 * c, part[r][c]);
      add_row(yr, tmp, nc, first, b);
    }
  }
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* AVX2 has 16 registers of 8 floats, and MR rows x 64 columns of running sums are 8 of them a
   row: the generic form below spilled them to the stack on every k (fp32 prefill ran at a tenth
   of ONNX Runtime's MatMul on a Zen 3).  Here one row keeps its 64 columns (8 sums hide the FMA
   latency) and several rows go in column halves of 32, up to three rows at a time (12 sums).
   Every (row, column) still takes the same FMAs in k order, so the numbers are the generic
   form's. */
static inline __attribute__((always_inline)) void half_panel(const Job* j, const float* x, float* y, size_t q,
                                                             const int R, const int C, size_t c0) {
  const Tiles* t = j->t;
  const size_t n0 = q * NR, nc = t->N - n0 < NR ? t->N - n0 : NR;
  const size_t cn = nc > c0 ? (nc - c0 < (size_t)(8 * C) ? nc - c0 : (size_t)(8 * C)) : 0;
  size_t koff = 0;
  for (size_t p = 0; p < t->lines; p++) {
    const size_t rows = t->rows[p];
    const float* w = t->w[p] + q * rows * NR + c0;
    __m256 acc[3][8];
    for (int r = 0; r < R; r++)
      for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (size_t k = 0; k < rows; k++, w += NR)
      for (int r = 0; r < R; r++) {
        const __m256 xv = _mm256_set1_ps(x[r * t->K + koff + k]);
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 8 * c), acc[r][c]);
      }
    const float* b = p + 1 == t->lines && t->bias ? t->bias + n0 + c0 : NULL;
    for (int r = 0; r < R; r++) {
      float* yr = y + r * t->N + n0 + c0;
      if (cn == (size_t)(8 * C)) {
        for (int c = 0; c < C; c++) {
          __m256 v = p == 0 ? acc[r][c] : _mm256_add_ps(_mm256_loadu_ps(yr + 8 * c), acc[r][c]);
          if (b) v = _mm256_add_ps(v, _mm256_loadu_ps(b + 8 * c));
          _mm256_storeu_ps(yr + 8 * c, v);
        }
      } else {
        float tmp[64];
        for (int c = 0; c < C; c++) _mm256_storeu_ps(tmp + 8 * c, acc[r][c]);
        add_row(yr, tmp, cn, p == 0, b);
      }
    }
    koff += rows;
  }
}

/* Rows [0, MR) of panels [q, q + NP), as the generic form below (same arguments). */
static inline __attribute__((always_inline)) void panel(const Job* j, const float* x, float* y, size_t q,
                                                        const int MR, const int NP) {
  for (int h = 0; h < NP; h++) {
    if (MR == 1) {
      half_panel(j, x, y, q + h, 1, 8, 0);
      continue;
    }
    int r0 = 0;
    for (; r0 + 3 <= MR; r0 += 3)
      for (size_t c0 = 0; c0 < NR; c0 += 32) half_panel(j, x + r0 * j->t->K, y + r0 * j->t->N, q + h, 3, 4, c0);
    for (; r0 + 2 <= MR; r0 += 2)
      for (size_t c0 = 0; c0 < NR; c0 += 32) half_panel(j, x + r0 * j->t->K, y + r0 * j->t->N, q + h, 2, 4, c0);
    for (; r0 < MR; r0++) half_panel(j, x + r0 * j->t->K, y + r0 * j->t->N, q + h, 1, 8, 0);
  }
}
#else
/* Rows [0, MR) of panels [q, q + NP) (NP panels side by side: 1, or 2 for one row): each mesh
   line computes its partial products x[:, its k-block] @ its tiles in registers, then reduces
   them into y along the line (chain order, as the graph form).  Every (row, column) sums its k
   in order whatever MR and NP, so a row's outputs do not depend on the other rows of its pass
   (a verification pass gives a decode step's numbers); one row takes two panels at a time so
   eight running sums, not four, hide the FMA latency. */
static inline __attribute__((always_inline)) void panel(const Job* j, const float* x, float* y, size_t q,
                                                        const int MR, const int NP) {
  const Tiles* t = j->t;
  size_t koff = 0;
  for (size_t p = 0; p < t->lines; p++) {
    const size_t rows = t->rows[p];
    const float* w = t->w[p] + q * rows * NR;
    v16 part[2][MAXR][4];
    for (int h = 0; h < NP; h++)
      for (int r = 0; r < MR; r++)
        for (int c = 0; c < 4; c++) part[h][r][c] = bc(0);
    for (size_t k = 0; k < rows; k++, w += NR) {
      for (int h = 0; h < NP; h++) {
        const float* wh = w + h * rows * NR; /* panel q + h of line p */
        const v16 w0 = ld(wh), w1 = ld(wh + 16), w2 = ld(wh + 32), w3 = ld(wh + 48);
        for (int r = 0; r < MR; r++) {
          const v16 xv = bc(x[r * t->K + koff + k]);
          part[h][r][0] += xv * w0; part[h][r][1] += xv * w1;
          part[h][r][2] += xv * w2; part[h][r][3] += xv * w3;
        }
      }
    }
    for (int h = 0; h < NP; h++) {
      const size_t n0 = (q + h) * NR, nc = t->N - n0 < NR ? t->N - n0 : NR;
      reduce_into(y + n0, t->N, nc, p == 0, p + 1 == t->lines && t->bias ? t->bias + n0 : NULL, part[h], MR);
    }
    koff += rows;
  }
}

#endif

/* One task: a run of panels (output columns) for every token row, two panels at a time: their
   blocks of rows, then the rows left one by one, across both panels. */
static void task(void* data, size_t i) {
  const Job* j = (const Job*)data;
  const size_t q0 = i * j->per_task;
  const size_t q1 = q0 + j->per_task < j->t->panels ? q0 + j->per_task : j->t->panels;
  const size_t K = j->t->K, N = j->t->N;
  size_t single = j->M / MAXR * MAXR; /* the first row left after the blocks of MAXR and of 4 */
  single += (j->M - single) / 4 * 4;
  for (size_t q = q0; q < q1; q += 2) {
    const size_t np = q + 1 < q1 ? 2 : 1;
    for (size_t h = 0; h < np; h++) {
      size_t m = 0;
      for (; m + MAXR <= j->M; m += MAXR) panel(j, j->x + m * K, j->y + m * N, q + h, MAXR, 1);
      for (; m + 4 <= j->M; m += 4) panel(j, j->x + m * K, j->y + m * N, q + h, 4, 1);
    }
    for (size_t m = single; m < j->M; m++) {
      if (np == 2)
        panel(j, j->x + m * K, j->y + m * N, q, 1, 2);
      else
        panel(j, j->x + m * K, j->y + m * N, q, 1, 1);
    }
  }
}

/* glu: a task's panels (as task), then the epilogue on each of them while they are in cache. */
static void task_glu(void* data, size_t i) {
  const Job* j = (const Job*)data;
  j->inner(data, i);
  const size_t q0 = i * j->per_task;
  const size_t q1 = q0 + j->per_task < j->t->panels ? q0 + j->per_task : j->t->panels;
  for (size_t q = q0; q < q1; q++) glu_panel(j->t->glu, j->y, j->t->N, j->out, j->t->out_n, j->M, q);
}

/* Transposed weights: output column n of token rows [m, m + MR) is, line by line, the dot product
   of row n's k-block with the token rows' k-block, reduced in line order. */
static inline __attribute__((always_inline)) void trow(const Job* j, size_t n, size_t m, const int MR) {
  const Tiles* t = j->t;
  const size_t K = t->K;
  const float* wr = t->w[0] + n * K;
  const float* x = j->x + m * K;
  float tot[TMAXR] = {0};
  size_t koff = 0;
  for (size_t p = 0; p < t->lines; p++) {
    const size_t rows = t->rows[p];
    v16 acc[TMAXR][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = bc(0);
    size_t k = koff;
    const size_t end = koff + rows;
    for (; k + 32 <= end; k += 32) {
      const v16 w0 = ld(wr + k), w1 = ld(wr + k + 16);
      for (int r = 0; r < MR; r++) {
        acc[r][0] += ld(x + r * K + k) * w0;
        acc[r][1] += ld(x + r * K + k + 16) * w1;
      }
    }
    for (; k + 16 <= end; k += 16) {
      const v16 w0 = ld(wr + k);
      for (int r = 0; r < MR; r++) acc[r][0] += ld(x + r * K + k) * w0;
    }
    for (int r = 0; r < MR; r++) {
      float s = hsum(acc[r][0] + acc[r][1]);
      for (size_t kk = k; kk < end; kk++) s += x[r * K + kk] * wr[kk];
      tot[r] = p == 0 ? s : tot[r] + s;
    }
    koff = end;
  }
  for (int r = 0; r < MR; r++) j->y[(m + r) * t->N + n] = t->bias ? tot[r] + t->bias[n] : tot[r];
}

static void ttask(void* data, size_t i) {
  const Job* j = (const Job*)data;
  const size_t n0 = i * j->per_task;
  const size_t n1 = n0 + j->per_task < j->t->N ? n0 + j->per_task : j->t->N;
  for (size_t n = n0; n < n1; n++) {
    size_t m = 0;
    for (; m + TMAXR <= j->M; m += TMAXR) trow(j, n, m, TMAXR);
    for (; m + 2 <= j->M; m += 2) trow(j, n, m, 2);
    for (; m < j->M; m++) trow(j, n, m, 1);
  }
}

/* ---- ONNX Runtime glue ---- */

static OrtStatus* error(const char* fmt, ...) {
  char msg[320];
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

/* The shape tensor vals[0] (int64 [lines + 1]: N and each line's K extent) into t. */
static OrtStatus* read_shape(const char* op, const OrtValue* v, size_t lines, Tiles* t) {
  int type = 0;
  size_t rank = 0;
  int64_t d[8];
  TRY(shape_of(v, &type, &rank, d));
  if (type != ELEM_INT64 || rank != 1 || (size_t)d[0] != lines + 1)
    return error("%s: shape must be an int64 tensor [%zu] (N and each line's K extent)", op, lines + 1);
  const int64_t* dims = NULL;
  TRY(CALL(GetTensorMutableData, GetTensorMutableDataFn)((OrtValue*)v, (void**)&dims));
  if (dims[0] < 1) return error("%s: N must be positive, got %lld", op, (long long)dims[0]);
  t->N = (size_t)dims[0];
  t->panels = (t->N + NR - 1) / NR;
  t->K = 0;
  for (size_t p = 0; p < lines; p++) {
    if (dims[p + 1] < 1) return error("%s: line %zu's K extent must be positive, got %lld", op, p, (long long)dims[p + 1]);
    t->rows[p] = (size_t)dims[p + 1];
    t->K += t->rows[p];
  }
  return NULL;
}

/* Check shape and the weights (vals[0..n_vals)) and point t at their data. */
static OrtStatus* resolve_tiles(const OrtValue* const* vals, size_t n_vals, int transposed, int glu, Tiles* t) {
  int type = 0;
  size_t rank = 0;
  int64_t d[8];
  memset(t, 0, sizeof *t);
  t->transposed = transposed;
  t->glu = glu;
  if (n_vals < 2) return error("MeshLinear: expected x, shape and the weights, got %zu inputs", n_vals + 1);
  TRY(shape_of(vals[0], &type, &rank, d));
  if (type != ELEM_INT64 || rank != 1 || d[0] < 2 || (size_t)d[0] - 1 > MAX_LINES)
    return error("MeshLinear: shape must be an int64 tensor [lines + 1] (N and each line's K extent)");
  t->lines = (size_t)d[0] - 1;
  const size_t n_w = transposed ? 1 : t->lines;
  if (n_vals != 1 + n_w && n_vals != 2 + n_w)
    return error("MeshLinear: shape names %zu lines, so expected x, shape, %s and an optional bias, got %zu inputs",
                 t->lines, transposed ? "one [N, K] weight (transposed=1)" : "one tile tensor per line", n_vals + 1);
  TRY(read_shape("MeshLinear", vals[0], t->lines, t));
  t->out_n = t->N;
  if (glu) { /* shape names the F gated outputs; the weights hold whole gate|up panels */
    if (transposed) return error("MeshLinear: glu needs the panel layout (transposed=0)");
    t->N = glu_columns(t->out_n);
    t->panels = t->N / NR;
  }
  if (n_vals == 2 + n_w) {
    TRY(shape_of(vals[1 + n_w], &type, &rank, d));
    if (type != ELEM_FLOAT || rank != 1 || (size_t)d[0] != t->N)
      return error("MeshLinear: bias must be a float tensor [%zu]", t->N);
    TRY(CALL(GetTensorMutableData, GetTensorMutableDataFn)((OrtValue*)vals[1 + n_w], (void**)&t->bias));
  }
  for (size_t p = 0; p < (transposed ? 1 : t->lines); p++) {
    TRY(shape_of(vals[1 + p], &type, &rank, d));
    if (transposed) {
      if (type != ELEM_FLOAT || rank != 2 || (size_t)d[0] != t->N || (size_t)d[1] != t->K)
        return error("MeshLinear: the transposed weight must be a float tensor [%zu, %zu] (N, K)", t->N, t->K);
    } else if (type != ELEM_FLOAT || rank != 3 || (size_t)d[0] != t->panels || (size_t)d[1] != t->rows[p] ||
               d[2] != NR) {
      return error("MeshLinear: line %zu's tiles must be a float tensor [%zu, %zu, %d] (N=%zu in panels of %d)", p,
                   t->panels, t->rows[p], NR, t->N, NR);
    }
    TRY(CALL(GetTensorMutableData, GetTensorMutableDataFn)((OrtValue*)vals[1 + p], (void**)&t->w[p]));
  }
  return NULL;
}

/* ---- the RMSNorm prologue (attributes norm, epsilon) ----
 *
 * In a pre-norm decoder every qkv and gate_up linear (and the LM head) reads
 * RMSNorm(residual + pending) * gamma, and the next layer needs residual + pending: one
 * SkipSimplifiedLayerNormalization node before the linear.  With norm != 0 the op does it
 * itself, once per token row before the linear's tasks:
 *   NORM_SKIP_RMS: inputs (x, skip, gamma, shape, ...), s = x + skip, the linear reads
 *                  s / sqrt(mean(s^2) + epsilon) * gamma; the optional second output is s [..., K]
 *                  (SkipSimplifiedLayerNormalization's input_skip_bias_sum);
 *   NORM_RMS:      inputs (x, gamma, shape, ...), the same without skip (a first layer's norm).
 * The same float operations as ONNX Runtime's kernels (sum of squares in float, divide, then
 * multiply by gamma), so the outputs match the separate nodes' to float rounding.
 */
enum { NORM_NONE = 0, NORM_SKIP_RMS = 1, NORM_RMS = 2 };
#define SLOT_KernelInfoGetAttribute_float 85
typedef OrtStatus* (*GetAttrFloatFn)(const OrtKernelInfo* info, const char* name, float* out);

/* Inputs the norm takes between x and shape. */
static size_t norm_inputs(int norm) { return norm == NORM_SKIP_RMS ? 2 : norm == NORM_RMS ? 1 : 0; }

/* The optional norm and epsilon attributes (absent: NORM_NONE; epsilon 1e-6). */
static OrtStatus* norm_attributes(const char* op, const OrtKernelInfo* info, int* norm, float* eps) {
  int64_t v = NORM_NONE;
  OrtStatus* s = CALL(KernelInfoGetAttribute_int64, GetAttrInt64Fn)(info, "norm", &v);
  if (s) {
    CALL(ReleaseStatus, ReleaseStatusFn)(s);
    v = NORM_NONE;
  }
  if (v != NORM_NONE && v != NORM_SKIP_RMS && v != NORM_RMS)
    return error("%s: norm must be 0 (none), 1 (skip + RMSNorm) or 2 (RMSNorm), got %lld", op, (long long)v);
  *norm = (int)v;
  *eps = 1e-6f;
  s = CALL(KernelInfoGetAttribute_float, GetAttrFloatFn)(info, "epsilon", eps);
  if (s) CALL(ReleaseStatus, ReleaseStatusFn)(s);
  if (!(*eps >= 0.0f)) return error("%s: epsilon must be >= 0", op);
  return NULL;
}

/* The norm's rows into *xn (a new [M, K] buffer the caller frees; NULL when norm is NORM_NONE),
   and with NORM_SKIP_RMS x + skip into the second output where the node has one. */
static OrtStatus* norm_prologue(const char* op, int norm, float eps, size_t K, OrtKernelContext* ctx,
                                const OrtValue* xv, float** xn) {
  *xn = NULL;
  if (norm == NORM_NONE) return NULL;
  int type = 0, ty2 = 0;
  size_t rank = 0, r2 = 0;
  int64_t dims[8], d2[8];
  const OrtValue *skv = NULL, *gv = NULL;
  const float *x = NULL, *skip = NULL, *gamma = NULL;
  TRY(shape_of(xv, &type, &rank, dims));
  if (type != ELEM_FLOAT || rank < 1 || (size_t)dims[rank - 1] != K)
    return error("%s: x must be a float tensor [..., %zu]", op, K);
  TRY(CALL(GetTensorMutableData, GetTensorMutableDataFn)((OrtValue*)xv, (void**)&x));
  if (norm == NORM_SKIP_RMS) {
    TRY(CALL(KernelContext_GetInput, GetInputFn)(ctx, 1, &skv));
    TRY(shape_of(skv, &ty2, &r2, d2));
    if (ty2 != ELEM_FLOAT || r2 != rank || memcmp(d2, dims, rank * sizeof *dims))
      return error("%s: skip must be a float tensor of x's shape", op);
    TRY(CALL(GetTensorMutableData, GetTensorMutableDataFn)((OrtValue*)skv, (void**)&skip));
  }
  TRY(CALL(KernelContext_GetInput, GetInputFn)(ctx, norm == NORM_SKIP_RMS ? 2 : 1, &gv));
  TRY(shape_of(gv, &ty2, &r2, d2));
  if (ty2 != ELEM_FLOAT || r2 != 1 || (size_t)d2[0] != K) return error("%s: gamma must be a float tensor [%zu]", op, K);
  TRY(CALL(GetTensorMutableData, GetTensorMutableDataFn)((OrtValue*)gv, (void**)&gamma));
  size_t M = 1;
  for (size_t i = 0; i + 1 < rank; i++) M *= (size_t)dims[i];
  float* sum = NULL; /* the second output, where the node has one */
  if (norm == NORM_SKIP_RMS) {
    OrtValue* sv = NULL;
    OrtStatus* s = CALL(KernelContext_GetOutput, GetOutputFn)(ctx, 1, dims, rank, &sv);
    if (s) CALL(ReleaseStatus, ReleaseStatusFn)(s);
    else if (sv) TRY(CALL(GetTensorMutableData, GetTensorMutableDataFn)(sv, (void**)&sum));
  }
  float* out = NULL;
  if (posix_memalign((void**)&out, 64, (M ? M : 1) * K * sizeof(float)))
    return CALL(CreateStatus, CreateStatusFn)(ORT_FAIL, "MeshLinear: out of memory in the norm");
  for (size_t m = 0; m < M; m++) {
    const float* a = x + m * K;
    float* o = out + m * K;
    float ms = 0.0f;
    if (skip) {
      for (size_t k = 0; k < K; k++) {
        const float v = a[k] + skip[m * K + k];
        o[k] = v;
        ms += v * v;
      }
      if (sum) memcpy(sum + m * K, o, K * sizeof(float));
    } else {
      for (size_t k = 0; k < K; k++) {
        o[k] = a[k];
        ms += a[k] * a[k];
      }
    }
    const float denom = __builtin_sqrtf(ms / (float)K + eps);
    for (size_t k = 0; k < K; k++) o[k] = o[k] / denom * gamma[k];
  }
  *xn = out;
  return NULL;
}

typedef struct {
  int transposed, glu, norm;
  float eps;
  Tiles tiles; /* resolved at load time when every weight input is a constant initializer */
} Kernel;

/* Tasks of >= ~64K multiply-adds (MLAS's own threading grain) over `units` whole units of work
   (MeshLinear's and MeshLinearQ's panels, or transposed runs of columns): the task count, and
   the units per task in *per_task. */
static size_t split_tasks(size_t M, size_t N, size_t K, size_t units, size_t* per_task) {
  size_t tasks = (size_t)((double)M * (double)N * (double)K / 65536.0);
  if (tasks < 1) tasks = 1;
  if (tasks > units) tasks = units;
  *per_task = (units + tasks - 1) / tasks;
  return (units + *per_task - 1) / *per_task;
}

/* ---- a cancel inside a node ----
 * ONNX Runtime looks at RunOptions.terminate only between nodes, so a cancel that lands in a long
 * node (a prefill's linears and attention: tens of ms at 0.5B) waits for its end.  The thread that
 * runs the graph (the sequential executor runs every node's compute on the caller's thread) binds
 * its generation's flag with spark_bind_abort; a cancel sets the flag together with terminate, and
 * run_tasks then skips the tasks not yet started.  The node's output is left unfinished: ONNX
 * Runtime stops at the next node, and a run that ends anyway (the last node was cut short) is
 * discarded by its caller, which knows it was cancelled (engine.generate).  A second word, `watch`
 * (NULL: none), is one a client on the same machine sets in shared memory
 * (engine/service/cancel_flags.py): it stops the tasks the same way, with no thread of the daemon
 * woken to set the first. */
static __thread const volatile int* abort_flag;
static __thread const volatile int* abort_watch;

__attribute__((visibility("default"))) void spark_bind_abort(const int* flag, const int* watch) {
  abort_flag = flag;
  abort_watch = watch;
}

typedef struct {
  void (*fn)(void*, size_t);
  void* job;
  const volatile int* flag;
  const volatile int* watch;
} Abortable;

static inline int aborted(const volatile int* flag, const volatile int* watch) {
  return *flag || (watch && *watch);
}

static void abortable_task(void* data, size_t i) {
  const Abortable* a = (const Abortable*)data;
  if (!aborted(a->flag, a->watch)) a->fn(a->job, i);
}

/* Run fn(job, 0 .. tasks-1): on this thread when there is one task, else on ORT's pool; none that
   starts after the bound flag is set (see above). */
static OrtStatus* run_tasks(OrtKernelContext* ctx, void (*fn)(void*, size_t), size_t tasks, void* job) {
  const volatile int* flag = abort_flag;
  const volatile int* watch = abort_watch;
  if (flag && aborted(flag, watch)) return NULL;
  if (tasks > 1) {
    if (!flag) return CALL(KernelContext_ParallelFor, ParallelForFn)(ctx, fn, tasks, 0, job);
    Abortable a = {fn, job, flag, watch};
    return CALL(KernelContext_ParallelFor, ParallelForFn)(ctx, abortable_task, tasks, 0, &a);
  }
  fn(job, 0);
  return NULL;
}

/* The activations of a linear op and its output: x's rows (``xdata`` in place of x's own values
   where the norm prologue made them), M = the rows of every leading dimension, and output 0 of
   x's shape with out_n columns. */
static OrtStatus* rows_and_output(const char* op, size_t K, size_t out_n, OrtKernelContext* ctx, const OrtValue* xv,
                                  const float* xdata, const float** x, size_t* M, float** y) {
  int type = 0;
  size_t rank = 0;
  int64_t dims[8];
  TRY(shape_of(xv, &type, &rank, dims));
  if (type != ELEM_FLOAT || rank < 1) return error("%s: x must be a float tensor of rank >= 1", op);
  if ((size_t)dims[rank - 1] != K)
    return error("%s: x has %zu features but the lines' K extents sum to %zu", op, (size_t)dims[rank - 1], K);
  TRY(CALL(GetTensorMutableData, GetTensorMutableDataFn)((OrtValue*)xv, (void**)x));
  if (xdata) *x = xdata;
  *M = 1;
  for (size_t i = 0; i + 1 < rank; i++) *M *= (size_t)dims[i];
  dims[rank - 1] = (int64_t)out_n;
  OrtValue* out = NULL;
  TRY(CALL(KernelContext_GetOutput, GetOutputFn)(ctx, 0, dims, rank, &out));
  return CALL(GetTensorMutableData, GetTensorMutableDataFn)(out, (void**)y);
}

/* xdata: the activations to use instead of xv's (the norm prologue's rows; xv gives the shape). */
static OrtStatus* run(const Tiles* t, OrtKernelContext* ctx, const OrtValue* xv, const float* xdata) {
  Job j = {.t = t};
  TRY(rows_and_output("MeshLinear", t->K, t->out_n, ctx, xv, xdata, &j.x, &j.M, &j.y));
  if (j.M == 0) return NULL;
  float* scratch = NULL; /* glu: the gate|up sums, [M, N] */
  if (t->glu) {
    if (posix_memalign((void**)&scratch, 64, j.M * t->N * sizeof(float)))
      return CALL(CreateStatus, CreateStatusFn)(ORT_FAIL, "MeshLinear: out of memory");
    j.out = j.y;
    j.y = scratch;
  }
  /* whole panels per task (or runs of 16 output columns, transposed) */
  const size_t tasks = split_tasks(j.M, t->N, t->K, t->transposed ? (t->N + 15) / 16 : t->panels, &j.per_task);
  void (*fn)(void*, size_t) = task;
  if (t->transposed) {
    j.per_task *= 16;
    fn = ttask;
  }
  if (t->glu) {
    j.inner = fn;
    fn = task_glu;
  }
  OrtStatus* s = run_tasks(ctx, fn, tasks, &j);
  free(scratch);
  return s;
}

static OrtStatus* compute(void* kernel, OrtKernelContext* ctx) {
  Kernel* k = (Kernel*)kernel;
  size_t n_in = 0;
  const OrtValue* x = NULL;
  TRY(CALL(KernelContext_GetInputCount, GetInputCountFn)(ctx, &n_in));
  TRY(CALL(KernelContext_GetInput, GetInputFn)(ctx, 0, &x));
  Tiles t;
  const Tiles* tp = &k->tiles;
  if (!k->tiles.lines) { /* weights fed at run time (not initializers): check and resolve them for this call */
    const size_t skip = 1 + norm_inputs(k->norm);
    const OrtValue* vals[2 + MAX_LINES];
    if (n_in < skip + 2 || n_in - skip > 2 + MAX_LINES)
      return error("MeshLinear: expected x, %sshape, 1 to %d mesh lines of tiles and an optional bias, got %zu inputs",
                   k->norm ? "the norm's inputs, " : "", MAX_LINES, n_in);
    for (size_t i = skip; i < n_in; i++) TRY(CALL(KernelContext_GetInput, GetInputFn)(ctx, i, &vals[i - skip]));
    TRY(resolve_tiles(vals, n_in - skip, k->transposed, k->glu, &t));
    tp = &t;
  }
  float* xn = NULL;
  TRY(norm_prologue("MeshLinear", k->norm, k->eps, tp->K, ctx, x, &xn));
  OrtStatus* s = run(tp, ctx, x, xn);
  free(xn);
  return s;
}

/* The optional glu attribute (GLU_*; absent: GLU_NONE). */
static OrtStatus* glu_attribute(const char* op, const OrtKernelInfo* info, int64_t* glu) {
  OrtStatus* s = CALL(KernelInfoGetAttribute_int64, GetAttrInt64Fn)(info, "glu", glu);
  if (s) {
    CALL(ReleaseStatus, ReleaseStatusFn)(s);
    *glu = GLU_NONE;
  }
  if (*glu != GLU_NONE && *glu != GLU_SILU && *glu != GLU_GELU_TANH)
    return error("%s: glu must be 0 (none), 1 (silu) or 2 (gelu_tanh), got %lld", op, (long long)*glu);
  return NULL;
}

static OrtStatus* create_kernel(const OrtCustomOp* op, OrtApiTable a, const OrtKernelInfo* info, void** out) {
  (void)op; (void)a;
  size_t n_in = 0;
  int64_t transposed = 0;
  TRY(CALL(KernelInfo_GetInputCount, KernelInfoGetInputCountFn)(info, &n_in));
  OrtStatus* s = CALL(KernelInfoGetAttribute_int64, GetAttrInt64Fn)(info, "transposed", &transposed);
  if (s) { /* absent: the default, 0 */
    CALL(ReleaseStatus, ReleaseStatusFn)(s);
    transposed = 0;
  }
  if (transposed != 0 && transposed != 1) return error("MeshLinear: transposed must be 0 or 1, got %lld", (long long)transposed);
  int64_t glu = 0;
  TRY(glu_attribute("MeshLinear", info, &glu));
  int norm = NORM_NONE;
  float eps = 0.0f;
  TRY(norm_attributes("MeshLinear", info, &norm, &eps));
  const size_t first = 1 + norm_inputs(norm); /* shape's input index */
  if (n_in < first + 2 || n_in - first > 2 + MAX_LINES)
    return error("MeshLinear: expected x, %sshape, 1 to %d mesh lines of tiles and an optional bias, got %zu inputs",
                 norm ? "the norm's inputs, " : "", MAX_LINES, n_in);
  Kernel* k = calloc(1, sizeof *k);
  if (!k) return CALL(CreateStatus, CreateStatusFn)(ORT_FAIL, "MeshLinear: out of memory");
  k->transposed = (int)transposed;
  k->glu = (int)glu;
  k->norm = norm;
  k->eps = eps;
  const OrtValue* vals[2 + MAX_LINES];
  int all_constant = 1;
  for (size_t i = first; i < n_in && all_constant; i++) {
    int is_const = 0;
    s = CALL(KernelInfoGetConstantInput_tensor, GetConstantInputFn)(info, i, &is_const, &vals[i - first]);
    if (s) {
      free(k);
      return s;
    }
    all_constant = is_const && vals[i - first];
  }
  if (all_constant) {
    s = resolve_tiles(vals, n_in - first, k->transposed, k->glu, &k->tiles);
    if (s) {
      free(k);
      return s;
    }
  }
  *out = k;
  return NULL;
}

static void destroy_kernel(void* kernel) { free(kernel); }

static const char* op_name(const OrtCustomOp* op) { (void)op; return "MeshLinear"; }
static const char* op_provider(const OrtCustomOp* op) { (void)op; return "CPUExecutionProvider"; }
static int float_type(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return ELEM_FLOAT; }
static int x_then_any(const OrtCustomOp* op, size_t i) { (void)op; return i == 0 ? ELEM_FLOAT : 0 /* any */; }
static size_t two(const OrtCustomOp* op) { (void)op; return 2; }
static int input_char(const OrtCustomOp* op, size_t i) { (void)op; return i == 0 ? CHAR_REQUIRED : CHAR_VARIADIC; }
/* output 1: the norm prologue's x + skip (optional) */
static int output_char(const OrtCustomOp* op, size_t i) { (void)op; return i == 0 ? CHAR_REQUIRED : CHAR_OPTIONAL; }
static int mem_default(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return 0; }
static int min_arity(const OrtCustomOp* op) { (void)op; return 1; }
static int homogeneous(const OrtCustomOp* op) { (void)op; return 1; }
static int heterogeneous(const OrtCustomOp* op) { (void)op; return 0; }

static const OrtCustomOp mesh_linear = {
    .version = API_VERSION,
    .GetName = op_name,
    .GetExecutionProviderType = op_provider,
    .GetInputType = x_then_any,
    .GetInputTypeCount = two,
    .GetOutputType = float_type,
    .GetOutputTypeCount = two,
    .KernelDestroy = destroy_kernel,
    .GetInputCharacteristic = input_char,
    .GetOutputCharacteristic = output_char,
    .GetInputMemoryType = mem_default,
    .GetVariadicInputMinArity = min_arity,
    .GetVariadicInputHomogeneity = heterogeneous,
    .GetVariadicOutputMinArity = min_arity,
    .GetVariadicOutputHomogeneity = homogeneous,
    .CreateKernelV2 = create_kernel,
    .KernelComputeV2 = compute,
};

/* ---- spark.wafer::MeshLinearQ: the same partitioned linear with int8 / int4 weights ----
 *
 *   y[..., N] = MeshLinearQ(x[..., K], shape, codes_0, scales_0, zero_points_0, ..., codes_{L-1}, ... [, bias])
 *   attributes: bits (8 or 4), block_size (weights per scale along K, a multiple of 16); glu, norm and
 *   epsilon as MeshLinear's (the epilogue and prologue are the same functions)
 *
 * shape: int64 [L+1] = (N, k_0, ..., k_{L-1}), the output columns and each mesh line's K extent.
 * Line p's weights are block-quantised along K like MatMulNBits' (one scale and zero point per
 * block of block_size weights and column; the last block of a line zero-padded), and stored in
 * the layout the kernel reads, so the initializers are used in place (no packed copy at load):
 *   codes        uint8 [panels, nb_p * block_size * bits / 32, 256]: panel q holds columns
 *                [64q, 64q + 64); int8: each 256 bytes are 4 consecutive k of 64 columns, column
 *                c's 4 codes in bytes 4c..4c+3; int4: 8 consecutive k, column c's k 0..3 in the
 *                low nibbles and k 4..7 in the high nibbles of bytes 4c..4c+3
 *   scales       float [panels, nb_p, 64]; at 4 bits float16 (at blocks of 32 a float32 scale added a
 *                quarter to the bytes of the codes a decode step streams, a half float an eighth)
 *   zero_points  uint8 [panels, nb_p, 64]   (w = (code - zero_point) * scale)
 * (engine/wafer/mesh_op.py: pack_quantized writes this layout.)  bias (optional) float [N] is added
 * after the last line's reduction, as in MeshLinear.
 *
 * Activations are quantised per row and per block to int8 (symmetric, scale = max|x| / 127,
 * round to nearest even), as MatMulNBits does with accuracy_level=4, so the products are int8
 * dot products (VNNI where the CPU has it).  Each row is quantised and computed on its own:
 * a row's result does not depend on the other rows of the batch.  Each mesh line's partial
 * products are reduced into the output in line order, the chain reduction of MeshLinear.
 */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_VNNI 1
#else
#define HAVE_VNNI 0
#endif
/* AVX2 + FMA + F16C without AVX-512 VNNI (AMD Zen 2/3, Intel before Ice Lake, most laptops):
   the same integer dot products from vpmaddubsw / vpmaddwd (see "the AVX2 loop" below). */
#if !HAVE_VNNI && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_AVX2Q 1
#define XW_K 256 /* int8: activations widened to int16 per this many k */
#else
#define HAVE_AVX2Q 0
#endif
#define QMAXR 3 /* token rows per pass over the weights */

/* An IEEE half float's value (the portable path; the vector paths convert 16 at a time). */
static inline float half_value(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  uint32_t bits;
  if (e == 0x1F) {
    bits = sign | 0x7F800000u | (m << 13);
  } else if (e == 0) { /* zero or subnormal: m * 2^-24 */
    const float f = (float)m * 5.9604644775390625e-08f;
    return sign ? -f : f;
  } else {
    bits = sign | ((e + 112u) << 23) | (m << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

typedef struct {
  int bits;
  size_t bs, lines, K, N, panels, Kq, blocks; /* Kq: quantised activations per row (lines padded to whole blocks) */
  size_t k[MAX_LINES], nb[MAX_LINES];
  const uint8_t* codes[MAX_LINES];
  const void* scales[MAX_LINES]; /* float, or at 4 bits IEEE half floats (half) */
  int half;
  const uint8_t* zp[MAX_LINES];
  const float* bias; /* [N], added after the last line's reduction; NULL: none */
  int glu;           /* GLU_*: the gated-MLP epilogue, as MeshLinear's (N counts the gate|up panel columns) */
  size_t out_n;      /* output columns: N, or with glu the F gated columns */
} QTiles;

/* Scale i of a line's scales. */
static inline float scale_at(const QTiles* t, const void* sc, size_t i) {
  return t->half ? half_value(((const uint16_t*)sc)[i]) : ((const float*)sc)[i];
}

#if HAVE_VNNI
/* Scales [i, i + 16) of a line's scales (half floats: AVX-512F's conversion, exact). */
static inline __m512 scales16(const QTiles* t, const void* sc, size_t i) {
  return t->half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)sc + i)))
                 : _mm512_loadu_ps((const float*)sc + i);
}
#endif

typedef struct {
  const QTiles* t;
  const int8_t* xq;    /* [M, Kq] */
  const float* xs;     /* [M, blocks] activation scales */
  const int32_t* xsum; /* [M, blocks] sums of the quantised activations (for the zero points) */
  float* y;            /* [M, N] */
  size_t M, panels_per_task;
  size_t amx_rows; /* > 0: the AMX path, this many token rows per tile pass (see below) */
  const int8_t* xqb; /* AMX: the quantised activations block-major, [blocks][xrows][bs] */
  size_t xrows;      /* AMX: rows padded to whole passes */
  float* out;                   /* glu: the op's output [M, out_n]; NULL: y is the output */
  void (*inner)(void*, size_t); /* glu: the task that fills y before the epilogue */
} QJob;

/* Round to nearest even for |v| < 2^22 (the FPU's default mode), without libm. */
static inline float round_even(float v) {
  const float magic = 12582912.0f; /* 1.5 * 2^23 */
  return v >= 0 ? (v + magic) - magic : -((-v + magic) - magic);
}

static void quantize_rows(const QTiles* t, const float* x, size_t M, int8_t* xq, float* xs, int32_t* xsum) {
  for (size_t m = 0; m < M; m++) {
    const float* xr = x + m * t->K;
    int8_t* qr = xq + m * t->Kq;
    size_t kx = 0, blk = 0;
    for (size_t p = 0; p < t->lines; p++) {
      for (size_t b = 0; b < t->nb[p]; b++, blk++) {
        const size_t k0 = b * t->bs, len = t->k[p] - k0 < t->bs ? t->k[p] - k0 : t->bs;
        const float* v = xr + kx + k0;
        int8_t* q = qr + k0;
        float amax = 0.0f;
        int32_t sum = 0;
#if HAVE_VNNI /* the same values 16 at a time (cvtps rounds to nearest even, as round_even) */
        const __mmask16 tail = (__mmask16)((1u << (len % 16)) - 1);
        __m512 vmax = _mm512_setzero_ps();
        for (size_t i = 0; i < len; i += 16)
          vmax = _mm512_max_ps(_mm512_abs_ps(_mm512_maskz_loadu_ps(i + 16 <= len ? 0xFFFF : tail, v + i)), vmax);
        amax = _mm512_reduce_max_ps(vmax);
        const __m512 inv = _mm512_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
        __m512i vsum = _mm512_setzero_si512();
        size_t i = 0;
        for (; i < len; i += 16) {
          const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(i + 16 <= len ? 0xFFFF : tail, v + i), inv));
          _mm_storeu_si128((__m128i*)(q + i), _mm512_cvtsepi32_epi8(c));
          vsum = _mm512_add_epi32(vsum, c);
        }
        sum = _mm512_reduce_add_epi32(vsum);
        memset(q + i, 0, t->bs - i);
#else /* the portable loops; with AVX2 the first len8 values 8 at a time, the rest here */
#if HAVE_AVX2Q
        const size_t len8 = len / 8 * 8;
        const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
        __m256 vmax = _mm256_setzero_ps();
        for (size_t i = 0; i < len8; i += 8) vmax = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(v + i), abs_mask), vmax);
        float lanes[8];
        _mm256_storeu_ps(lanes, vmax);
        for (int l = 0; l < 8; l++) amax = lanes[l] > amax ? lanes[l] : amax;
#else
        const size_t len8 = 0;
#endif
        for (size_t i = len8; i < len; i++) {
          const float a = v[i] < 0 ? -v[i] : v[i];
          amax = a > amax ? a : amax;
        }
        const float inv = amax != 0.0f ? 127.0f / amax : 0.0f;
#if HAVE_AVX2Q
        const __m256 vinv = _mm256_set1_ps(inv);
        __m256i vsum = _mm256_setzero_si256();
        for (size_t i = 0; i < len8; i += 8) { /* cvtps rounds to nearest even, as round_even */
          const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + i), vinv));
          const __m128i c16 = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
          _mm_storel_epi64((__m128i*)(q + i), _mm_packs_epi16(c16, c16));
          vsum = _mm256_add_epi32(vsum, c);
        }
        int32_t sums[8];
        _mm256_storeu_si256((__m256i*)sums, vsum);
        for (int l = 0; l < 8; l++) sum += sums[l];
#endif
        for (size_t i = len8; i < len; i++) {
          const int32_t c = (int32_t)round_even(v[i] * inv);
          q[i] = (int8_t)c;
          sum += c;
        }
        memset(q + len, 0, t->bs - len);
#endif
        xs[m * t->blocks + blk] = amax / 127.0f;
        xsum[m * t->blocks + blk] = sum;
      }
      kx += t->k[p];
      qr += t->nb[p] * t->bs;
    }
  }
}

/* Bytes of codes of one block of a panel's line (bs k x NR columns), and of one panel of line p. */
static inline size_t qblock_bytes(const QTiles* t) { return t->bs * (size_t)t->bits / 32 * 256; }
static inline size_t qpanel_bytes(const QTiles* t, size_t p) { return t->nb[p] * qblock_bytes(t); }

typedef struct {
  const uint8_t *codes, *zp;
  const char* scales;
} QSegment;

/* Where panel q's line p starts in the codes, scales and zero points.  A task streams its panels'
   segments in (q, p) order: after a segment comes the next line's (p + 1), or line 0 of the next
   panel (p = lines); NULL past the last panel. */
static inline QSegment qsegment(const QTiles* t, size_t p, size_t q) {
  QSegment s = {NULL, NULL, NULL};
  if (p == t->lines) p = 0, q++;
  if (q >= t->panels) return s;
  s.codes = t->codes[p] + q * qpanel_bytes(t, p);
  s.zp = t->zp[p] + q * t->nb[p] * NR;
  s.scales = (const char*)t->scales[p] + q * t->nb[p] * NR * (t->half ? 2 : 4);
  return s;
}

/* Panel q's line p as the loops read it: nb blocks of codes from `codes` to `end`, their scales
   from element s0 of `scales` and their zero points from `zp`; `here` and `next` are this segment
   and the one after it in a task's stream (qsegment), which the prefetches run into. */
typedef struct {
  const uint8_t *codes, *end, *zp;
  const void* scales;
  size_t nb, s0;
  QSegment here, next;
} QLine;

static inline QLine qline(const QTiles* t, size_t p, size_t q) {
  QLine L;
  L.nb = t->nb[p];
  L.codes = t->codes[p] + q * qpanel_bytes(t, p);
  L.end = L.codes + qpanel_bytes(t, p);
  L.scales = t->scales[p];
  L.s0 = q * L.nb * NR; /* the panel's first scale */
  L.zp = t->zp[p] + q * L.nb * NR;
  L.here = qsegment(t, p, q);
  L.next = qsegment(t, p + 1, q);
  return L;
}

#if HAVE_VNNI || HAVE_AVX2Q
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 8192 /* how far ahead of the codes being read to prefetch (measured: 2-32 KB) */
#endif
/* Into L2 (T1), not L1 (T0): an L1 tracks far fewer outstanding misses than an L2, and with the
   prefetches queued there the stream had too few in flight to keep up with DRAM; the loads then
   find the lines in L2 (docs/speed.md, "What limits int4 at 1.5B"). */
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_T1
#endif
#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 2 /* how many blocks ahead to prefetch the scales and zero points */
#endif

/* A decode step streams each weight once from DRAM, and the hardware prefetchers stop at every
   4 KB page and at every jump to another segment: ask for the codes ``ahead`` bytes (PREFETCH_BYTES,
   or a block where blocks are larger) ahead of the load, past the segment's end (``end``) into the next one (``next``), so the loads do not wait
   on DRAM between bursts of arithmetic (docs/wafer.md). */
static inline __attribute__((always_inline)) void prefetch_codes(const uint8_t* w, size_t bytes, const uint8_t* end,
                                                                  const uint8_t* next, size_t ahead) {
  uintptr_t pf = (uintptr_t)w + ahead;
  if (pf >= (uintptr_t)end) {
    if (next == NULL) return;
    pf = (uintptr_t)next + (pf - (uintptr_t)end);
  }
  for (size_t o = 0; o < bytes; o += 64) _mm_prefetch((const char*)(pf + o), PREFETCH_HINT);
}

/* The scales and zero points of block b of a segment of nb blocks, or of block b - nb of the next
   segment (``next``). */
static inline void prefetch_meta(const QTiles* t, QSegment here, QSegment next, size_t b, size_t nb) {
  if (b >= nb) {
    if (next.codes == NULL) return;
    here = next, b -= nb;
  }
  const size_t sb = t->half ? 2 : 4;
  for (size_t o = 0; o < NR * sb; o += 64) _mm_prefetch(here.scales + b * NR * sb + o, PREFETCH_HINT);
  _mm_prefetch((const char*)(here.zp + b * NR), PREFETCH_HINT);
}
#endif

#if HAVE_VNNI
/* acc += the 4-byte dot products of u8 w and s8 x, in acc's register.  GCC 12 compiles
   _mm512_dpbusd_epi32 into a copy of the accumulator, the instruction and a copy back, and then
   reloads the weights once per token row: the int8 3-row loop ran 65 instructions a step for its
   12 vpdpbusd, 33 with the asm form, which ties the accumulator to its register (KEEP: a value
   held in its register, not reloaded from memory at each use). */
#if defined(__GNUC__) && !defined(__clang__)
#define DPBUSD(acc, w, x) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x))
#define KEEP(v) __asm__("" : "+v"(v))
#else
#define KEEP(v) ((void)0)
#define DPBUSD(acc, w, x) ((acc) = _mm512_dpbusd_epi32((acc), (w), (x)))
#endif
/* Whether this 256-byte step of a block is one whose codes this row group prefetches: with G
   groups reading each block in turn, group g takes every G-th step (from its g-th), so the next
   codes are asked for at the same rate all through the block, not only while its first group reads it. */
static inline int prefetch_turn(size_t* turn, size_t G) {
  if (*turn) {
    --*turn;
    return 0;
  }
  *turn = G - 1;
  return 1;
}

/* Block b (the op's block blk, its codes at w) of line L for token rows [m, m + MR): the exact int32 dot
   products of its 4 column groups, scaled into part[r][c] (float, blocks added in order).  Row
   group g of the G that read this block in turn prefetches its share of the codes PREFETCH_BYTES
   ahead (prefetch_turn), and the first group the next blocks' scales and zero points. */
static inline __attribute__((always_inline)) void qblock(const QJob* j, const QLine* L, const uint8_t* w, size_t b,
                                                         size_t blk, size_t kq, size_t m, const int MR, __m512 part[][4],
                                                         size_t g, size_t G) {
  const QTiles* t = j->t;
  const uint8_t *end = L->end, *zp = L->zp;
  const QSegment next = L->next;
  const size_t bs = t->bs;
  __m512i acc[QMAXR][4], odd[4];
  if (g == 0) prefetch_meta(t, L->here, next, b + PREFETCH_BLOCKS, L->nb);
  size_t turn = g; /* this group prefetches the steps i = g (mod G) */
  /* -zp * sum(a) as int16 products (madd_epi16: one uop, not mullo's two): zp < 256 and
     |sum(a)| <= 127 bs, which fits an int16 for blocks of up to 256 */
  for (int c = 0; c < 4; c++) {
    const __m512i z = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(zp + b * NR + 16 * c)));
    for (int r = 0; r < MR; r++) {
      const int32_t s = -j->xsum[(m + r) * t->blocks + blk];
      acc[r][c] = bs <= 256 ? _mm512_madd_epi16(z, _mm512_set1_epi32(s & 0xFFFF))
                            : _mm512_mullo_epi32(z, _mm512_set1_epi32(s));
    }
    odd[c] = _mm512_setzero_si512();
  }
  const int8_t* a = j->xq + m * t->Kq + kq + b * bs;
  if (t->bits == 8) {
    size_t k = 0;
    if (MR == 1) /* two groups of 4 k per step: eight independent accumulators */
#pragma GCC unroll 2
      for (; k + 8 <= bs; k += 8, w += 512) {
        for (int u = 0; u < 2; u++)
          if (prefetch_turn(&turn, G)) prefetch_codes(w + 256 * u, 256, end, next.codes, PREFETCH_BYTES);
        int32_t a0, a1;
        memcpy(&a0, a + k, 4);
        memcpy(&a1, a + k + 4, 4);
        const __m512i x0 = _mm512_set1_epi32(a0), x1 = _mm512_set1_epi32(a1);
        for (int c = 0; c < 4; c++) {
          DPBUSD(acc[0][c], _mm512_loadu_si512(w + 64 * c), x0);
          DPBUSD(odd[c], _mm512_loadu_si512(w + 256 + 64 * c), x1);
        }
      }
    for (; k < bs; k += 4, w += 256) {
      __m512i wv[4];
      if (prefetch_turn(&turn, G)) prefetch_codes(w, 256, end, next.codes, PREFETCH_BYTES);
      for (int c = 0; c < 4; c++) {
        wv[c] = _mm512_loadu_si512(w + 64 * c);
        KEEP(wv[c]); /* one load each, held in its register for every row */
      }
      for (int r = 0; r < MR; r++) {
        int32_t ar;
        memcpy(&ar, a + r * t->Kq + k, 4);
        const __m512i xv = _mm512_set1_epi32(ar);
        for (int c = 0; c < 4; c++) DPBUSD(acc[r][c], wv[c], xv);
      }
    }
  } else {
    const __m512i lo_mask = _mm512_set1_epi8(0x0F), hi_mask = _mm512_set1_epi8((char)0xF0);
    for (size_t k = 0; k < bs; k += 8, w += 256) {
      __m512i lo[4], hi[4];
      if (prefetch_turn(&turn, G)) prefetch_codes(w, 256, end, next.codes, PREFETCH_BYTES);
      for (int c = 0; c < 4; c++) {
        const __m512i v = _mm512_loadu_si512(w + 64 * c);
        lo[c] = _mm512_and_si512(v, lo_mask);
        /* one row: the high nibbles masked in place, 16 x the code (one uop, not a shift and a
           mask); their own accumulators then hold 16 x the exact sum (|sum| < 2^21 a block),
           shifted back at the block's end */
        hi[c] = MR == 1 ? _mm512_and_si512(v, hi_mask) : _mm512_and_si512(_mm512_srli_epi16(v, 4), lo_mask);
      }
      for (int r = 0; r < MR; r++) {
        int32_t a0, a1;
        memcpy(&a0, a + r * t->Kq + k, 4);
        memcpy(&a1, a + r * t->Kq + k + 4, 4);
        const __m512i x0 = _mm512_set1_epi32(a0), x1 = _mm512_set1_epi32(a1);
        for (int c = 0; c < 4; c++) {
          DPBUSD(acc[r][c], lo[c], x0);
          if (MR == 1) DPBUSD(odd[c], hi[c], x1);
          else DPBUSD(acc[r][c], hi[c], x1);
        }
      }
    }
  }
  if (MR == 1)
    for (int c = 0; c < 4; c++)
      acc[0][c] = _mm512_add_epi32(acc[0][c], t->bits == 4 ? _mm512_srai_epi32(odd[c], 4) : odd[c]);
  for (int r = 0; r < MR; r++) {
    const __m512 s = _mm512_set1_ps(j->xs[(m + r) * t->blocks + blk]);
    for (int c = 0; c < 4; c++)
      part[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]),
                                   _mm512_mul_ps(scales16(t, L->scales, L->s0 + b * NR + 16 * c), s), part[r][c]);
  }
}
#endif

/* Rows [m, m + MR) of panel q: every line's int dot products per block, scaled into float
   partial products, reduced into y in line order.

   The AVX2 loop (no VNNI: one instruction cannot sum four u8 x s8 products into an int32) takes
   a block's codes 8 columns (32 bytes of each 256-byte group) at a time.  int4: codes < 16 times
   activations in [-127, 127], so vpmaddubsw's int16 pair sums are exact and four groups of 8 k
   add up in int16 before vpmaddwd widens them (the four products of a column's 4 k, as dpbusd).
   int8: codes up to 255 would saturate vpmaddubsw, so codes and activations are widened to int16
   and vpmaddwd sums k pairs.  Either way the same exact int32 dot products as the VNNI and the
   portable loops, then the same float operations in the same order: bit-identical outputs. */
static inline __attribute__((always_inline)) void qpanel(const QJob* j, size_t m, size_t q, const int MR) {
  const QTiles* t = j->t;
  const size_t n0 = q * NR, nc = t->N - n0 < NR ? t->N - n0 : NR, bs = t->bs;
  size_t kq = 0, blk = 0;
  for (size_t p = 0; p < t->lines; p++) {
    const QLine L = qline(t, p, q);
    const size_t nb = L.nb;
    const uint8_t* w = L.codes;
#if HAVE_VNNI
    __m512 part[QMAXR][4];
    for (int r = 0; r < MR; r++)
      for (int c = 0; c < 4; c++) part[r][c] = _mm512_setzero_ps();
    for (size_t b = 0; b < nb; b++, blk++, w += qblock_bytes(t))
      qblock(j, &L, w, b, blk, kq, m, MR, part, 0, 1);
    reduce_into(j->y + m * t->N + n0, t->N, nc, p == 0, p + 1 == t->lines && t->bias ? t->bias + n0 : NULL,
                (v16(*)[4])part, MR);
#elif HAVE_AVX2Q /* the AVX2 loop: see above the function */
    const uint8_t *end = L.end, *zp = L.zp;
    const QSegment next = L.next;
    const size_t bbytes = qblock_bytes(t);
    float part[QMAXR][NR] __attribute__((aligned(32)));
    int32_t dots[QMAXR][NR] __attribute__((aligned(32)));
    int16_t xw[QMAXR][XW_K] __attribute__((aligned(32))); /* int8: activations as int16, XW_K at a time */
    for (int r = 0; r < MR; r++) memset(part[r], 0, sizeof(part[r]));
    const __m256i ones = _mm256_set1_epi16(1), lo_mask = _mm256_set1_epi8(0x0F);
    for (size_t b = 0; b < nb; b++, blk++, w += bbytes) {
      /* the next block's codes (or PREFETCH_BYTES ahead), an eighth per column group: asked for
         all at once at the block's start, an int8 block's 128 lines left the loads waiting (the
         spread measured a third faster at int8 on a Zen 3) */
      const size_t ahead = bbytes > PREFETCH_BYTES ? bbytes : PREFETCH_BYTES;
      const int8_t* a = j->xq + m * t->Kq + kq + b * bs;
      for (int c = 0; c < 8; c++) { /* -zp * sum(a), as the VNNI loop */
        const __m256i z = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(zp + b * NR + 8 * c)));
        for (int r = 0; r < MR; r++) {
          const int32_t s = -j->xsum[(m + r) * t->blocks + blk];
          _mm256_store_si256((__m256i*)(dots[r] + 8 * c), bs <= 256 ? _mm256_madd_epi16(z, _mm256_set1_epi32(s & 0xFFFF))
                                                                   : _mm256_mullo_epi32(z, _mm256_set1_epi32(s)));
        }
      }
      if (t->bits == 8) { /* codes and activations widened to int16: vpmaddwd sums k pairs exactly */
        for (size_t k0 = 0; k0 < bs; k0 += XW_K) {
          const size_t kn = bs - k0 < XW_K ? bs - k0 : XW_K;
          for (int r = 0; r < MR; r++)
            for (size_t k = 0; k < kn; k += 16)
              _mm256_store_si256((__m256i*)(xw[r] + k),
                                 _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(a + r * t->Kq + k0 + k))));
          for (int c = 0; c < 8; c++) { /* 8 columns at a time: 32 bytes of each 256-byte group */
            const uint8_t* wc = w + k0 / 4 * 256 + 32 * c;
            if (k0 == 0) prefetch_codes(w + c * (bbytes / 8), bbytes / 8, end, next.codes, ahead);
            __m256i lo[QMAXR], hi[QMAXR]; /* columns 0-3 and 4-7, two k pairs each */
            for (int r = 0; r < MR; r++) lo[r] = hi[r] = _mm256_setzero_si256();
            for (size_t k = 0; k < kn; k += 4, wc += 256) {
              const __m256i w0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)wc));
              const __m256i w1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(wc + 16)));
              for (int r = 0; r < MR; r++) {
                int64_t a4;
                memcpy(&a4, xw[r] + k, 8);
                const __m256i x = _mm256_set1_epi64x(a4);
                lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(w0, x));
                hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(w1, x));
              }
            }
            for (int r = 0; r < MR; r++) { /* pairs summed: columns (0 1 4 5 | 2 3 6 7), reordered */
              __m256i* d = (__m256i*)(dots[r] + 8 * c);
              *d = _mm256_add_epi32(*d, _mm256_permute4x64_epi64(_mm256_hadd_epi32(lo[r], hi[r]), 0xD8));
            }
          }
        }
      } else { /* int4: codes < 16, so vpmaddubsw's int16 pair sums never saturate */
        for (int c = 0; c < 8; c++) {
          const uint8_t* wc = w + 32 * c;
          prefetch_codes(w + c * (bbytes / 8), bbytes / 8, end, next.codes, ahead);
          __m256i acc[QMAXR];
          for (int r = 0; r < MR; r++) acc[r] = _mm256_load_si256((const __m256i*)(dots[r] + 8 * c));
          for (size_t k = 0; k < bs;) {
            __m256i s16[QMAXR];
            for (int r = 0; r < MR; r++) s16[r] = _mm256_setzero_si256();
            /* four groups of 8 k: an int16 lane sums 4 products a group, |sum| <= 16 x 15 x 127 < 2^15 */
            for (int g = 0; g < 4 && k < bs; g++, k += 8, wc += 256) {
              const __m256i v = _mm256_loadu_si256((const __m256i*)wc);
              const __m256i lo = _mm256_and_si256(v, lo_mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo_mask);
              for (int r = 0; r < MR; r++) {
                int32_t a0, a1;
                memcpy(&a0, a + r * t->Kq + k, 4);
                memcpy(&a1, a + r * t->Kq + k + 4, 4);
                s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(a0)));
                s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(a1)));
              }
            }
            for (int r = 0; r < MR; r++) acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(s16[r], ones));
          }
          for (int r = 0; r < MR; r++) _mm256_store_si256((__m256i*)(dots[r] + 8 * c), acc[r]);
        }
      }
      for (int c = 0; c < 8; c++) {
        const size_t si = L.s0 + b * NR + 8 * c;
        const __m256 sc8 = t->half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)L.scales + si)))
                                   : _mm256_loadu_ps((const float*)L.scales + si);
        for (int r = 0; r < MR; r++) {
          const __m256 xs = _mm256_set1_ps(j->xs[(m + r) * t->blocks + blk]);
          _mm256_store_ps(part[r] + 8 * c, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_load_si256((const __m256i*)(dots[r] + 8 * c))),
                                                           _mm256_mul_ps(sc8, xs), _mm256_load_ps(part[r] + 8 * c)));
        }
      }
    }
    for (int r = 0; r < MR; r++) {
      float* yr = j->y + (m + r) * t->N + n0;
      const float* b = p + 1 == t->lines && t->bias ? t->bias + n0 : NULL;
      add_row(yr, part[r], nc, p == 0, b);
    }
#else /* portable: the same arithmetic, one column at a time */
    for (int r = 0; r < MR; r++) {
      float part[NR];
      const uint8_t* wr = w;
      for (size_t c = 0; c < NR; c++) part[c] = 0.0f;
      for (size_t b = 0; b < nb; b++) {
        const int8_t* a = j->xq + (m + r) * t->Kq + kq + b * bs;
        int32_t acc[NR];
        const int32_t s = j->xsum[(m + r) * t->blocks + blk + b];
        for (size_t c = 0; c < NR; c++) acc[c] = -(int32_t)L.zp[b * NR + c] * s;
        const size_t group = t->bits == 8 ? 4 : 8;
        for (size_t k = 0; k < bs; k += group, wr += 256)
          for (size_t c = 0; c < NR; c++)
            for (size_t i = 0; i < 4; i++) {
              const uint8_t v = wr[4 * c + i];
              if (t->bits == 8) {
                acc[c] += (int32_t)v * a[k + i];
              } else {
                acc[c] += (int32_t)(v & 15) * a[k + i] + (int32_t)(v >> 4) * a[k + 4 + i];
              }
            }
        const float xsb = j->xs[(m + r) * t->blocks + blk + b];
        for (size_t c = 0; c < NR; c++) part[c] = __builtin_fmaf((float)acc[c], scale_at(t, L.scales, L.s0 + b * NR + c) * xsb, part[c]);
      }
      float* yr = j->y + (m + r) * t->N + n0;
      const float* b = p + 1 == t->lines && t->bias ? t->bias + n0 : NULL;
      add_row(yr, part, nc, p == 0, b);
    }
    blk += nb;
#endif
    kq += nb * bs;
  }
}

#if HAVE_VNNI
#ifndef QMULTI
#define QMULTI 16 /* up to this many token rows share one read of each block (qpanel_rows) */
#endif
/* Rows [0, M) of panel q, 3 < M <= QMULTI (a speculative verification pass): every row group
   takes each block in turn while it is in L1, instead of sweeping the whole panel once per
   QMAXR rows.  A sweep per group streamed the panel from DRAM only in the first one and left the
   memory idle while the others computed from L2, so a 9-row int8 pass cost the stream plus the
   arithmetic; block by block the stream runs under all of it.  Each row's float operations are
   those of qpanel, in the same order: the same outputs bit for bit. */
static void qpanel_rows(const QJob* j, size_t q) {
  const QTiles* t = j->t;
  const size_t M = j->M, n0 = q * NR, nc = t->N - n0 < NR ? t->N - n0 : NR;
  const size_t G = M / QMAXR + (M % QMAXR + 1) / 2; /* row groups: of 3, then of 2 or 1 */
  __m512 part[QMULTI][4];
  size_t kq = 0, blk = 0;
  for (size_t p = 0; p < t->lines; p++) {
    const QLine L = qline(t, p, q);
    const size_t nb = L.nb;
    const uint8_t* w = L.codes;
    for (size_t r = 0; r < M; r++)
      for (int c = 0; c < 4; c++) part[r][c] = _mm512_setzero_ps();
    for (size_t b = 0; b < nb; b++, blk++, w += qblock_bytes(t)) {
      size_t m = 0, g = 0;
      for (; m + QMAXR <= M; m += QMAXR, g++)
        qblock(j, &L, w, b, blk, kq, m, QMAXR, part + m, g, G);
      for (; m + 2 <= M; m += 2, g++) qblock(j, &L, w, b, blk, kq, m, 2, part + m, g, G);
      for (; m < M; m++, g++) qblock(j, &L, w, b, blk, kq, m, 1, part + m, g, G);
    }
    reduce_into(j->y + n0, t->N, nc, p == 0, p + 1 == t->lines && t->bias ? t->bias + n0 : NULL, (v16(*)[4])part,
                (int)M);
    kq += nb * t->bs;
  }
}
#endif

/* ---- MeshLinearQ's AMX path: passes of many token rows (speculative verification, prefill) ----
 *
 * Why: the VNNI loop above reads a panel's codes once per QMAXR rows and spends one dpbusd per
 * 16 columns x 4 k x row, so a 9-row verification pass costs ~9x the integer work of a decode step
 * (compute-bound, although the weights are read about once).  AMX-INT8 (Sapphire Rapids and
 * later) multiplies a [rows <= 16, 64 k] int8 tile by a [64 k, 16 columns] tile in one TDPB*D
 * instruction, so the same integer dot products cost a small fraction of that.  What a pass
 * still pays per block and row (storing the dots from the tiles, scaling them to float, the int4
 * unpack) is vector work, as on the VNNI path.
 *
 * When: M >= amx_min_rows (default AMX_MIN_ROWS: measured on a 896 x 4864 linear, AMX is as fast
 * as VNNI at 3 rows and faster from 4, 1.6x at 9 rows with int4 weights streamed from DRAM;
 * $SPARK_LSP_AMX_MIN_ROWS overrides it,
 * $SPARK_LSP_AMX=0 turns the path off so the VNNI one runs at every M), the library was built
 * with AMX (-march=native on such a CPU) and the CPU and kernel allow it: cpuid leaf 7 has
 * AMX-TILE and AMX-INT8, and Linux grants the process the tile data state (one
 * arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) per process).  Otherwise: the VNNI path.
 *
 * Layout (no repacking: the op reads the same initializers):
 *   tiles 0-3  C, int32 [R rows, 16 columns]: the panel's 4 column groups for R token rows
 *   tiles 4-5  A, int8  [R rows, kc k]: the quantised activations, copied block-major once per call
 *              ([blocks][rows][bs]: a tile's rows are bs bytes apart, one contiguous run), the two
 *              taking turns along k (AMX does not rename tiles: reloading the one the previous
 *              products still read would wait for them)
 *   tiles 6-7  B, [kc/4 rows, 64 bytes]: 4 consecutive k of 16 columns per row, the VNNI order
 *              the weights are already stored in: 16 columns of one 256-byte code group are 64
 *              bytes, so column group c is read in place at offset 64c with a 256-byte stride.
 *              int4 codes are first unpacked per block into a scratch block in the int8 order
 *              (low nibbles: k 0..3, high: k 4..7), with the block's zero point subtracted
 *              (code - zp is in [-15, 15], so TDPBSSD, signed x signed, and no correction);
 *              int8 codes are used as they are (TDPBSUD, signed activations x unsigned codes)
 *              and the zero point is corrected after the block, -zp * sum(a), as on the VNNI path.
 * R = M when M <= 16, else 16 (the activation rows are zero-padded to whole passes); kc = the
 * largest of 64, 32, 16 that divides the block size.
 * Numerics: per (row, block, column) the same exact int32 dot product as the VNNI path, then the
 * same float operations in the same order (part += float(dot) * (scale * x_scale), blocks in
 * order, lines reduced in chain order), so both paths give bit-identical outputs; a row's result
 * still does not depend on the other rows.
 */
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 4
#endif
#if HAVE_VNNI && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define HAVE_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define HAVE_AMX 0
#endif

static int amx_usable;
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;

static void amx_probe(void) {
#if HAVE_AMX
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 25) & 1)) return;
  amx_usable = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#endif
}

/* Whether MeshLinearQ was compiled with its AVX-512 VNNI loop (else the portable C one, several
   times slower than ONNX Runtime's own MatMulNBits kernels: engine/quant.py then defaults to those). */
__attribute__((visibility("default"))) int spark_mesh_vnni(void) { return HAVE_VNNI; }

/* Whether MeshLinearQ was compiled with its AVX2 loop (an AVX2 + FMA + F16C CPU without VNNI). */
__attribute__((visibility("default"))) int spark_mesh_avx2(void) { return HAVE_AVX2Q; }

/* Whether the AMX path can run in this process (asks Linux for the tile state on first call). */
__attribute__((visibility("default"))) int spark_mesh_amx(void) {
  pthread_once(&amx_once, amx_probe);
  return amx_usable;
}

/* AMX tasks run so far in this process (a diagnostic: tests check which path ran). */
static unsigned long amx_tasks;
__attribute__((visibility("default"))) unsigned long spark_mesh_amx_tasks(void) {
  return __atomic_load_n(&amx_tasks, __ATOMIC_RELAXED);
}

/* Token rows from which MeshLinearQ takes the AMX path in sessions created now (0: never). */
static size_t amx_min_rows(void) {
  const char* off = getenv("SPARK_LSP_AMX");
  if (off && (!strcmp(off, "0") || !strcasecmp(off, "off") || !strcasecmp(off, "false") || !strcasecmp(off, "no")))
    return 0;
  if (!spark_mesh_amx()) return 0;
  const char* rows = getenv("SPARK_LSP_AMX_MIN_ROWS");
  const long v = rows && *rows ? strtol(rows, NULL, 10) : AMX_MIN_ROWS;
  return v < 1 ? 1 : (size_t)v;
}

#if HAVE_AMX
typedef struct __attribute__((aligned(64))) {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} TileConfig;

/* kc more k of every column group into C tiles 0-3: the activations in tile TA (4 or 5, taking
   turns so a load need not wait for the previous step's products), the codes' column groups in
   tiles 6 and 7 (taking turns likewise; tiles are not renamed, so reusing one stalls). */
#define AMX_STEP(TA, DP, kk)                  \
  do {                                        \
    const uint8_t* bk = bw + ((kk) / 4) * 256; \
    _tile_loadd(TA, a + (kk), bs);            \
    _tile_loadd(6, bk, 256);                  \
    DP(0, TA, 6);                             \
    _tile_loadd(7, bk + 64, 256);             \
    DP(1, TA, 7);                             \
    _tile_loadd(6, bk + 128, 256);            \
    DP(2, TA, 6);                             \
    _tile_loadd(7, bk + 192, 256);            \
    DP(3, TA, 7);                             \
  } while (0)

/* int4: block b's codes minus their zero points, as int8 in the 4-k order B tiles read
   ([bs / 4, 256]: row 2g holds k 8g..8g+3 of the 64 columns, row 2g+1 k 8g+4..8g+7). */
static inline void amx_unpack4(const uint8_t* codes, const uint8_t* zp, size_t bs, uint8_t* out) {
  const __m512i lo_mask = _mm512_set1_epi8(0x0F);
  __m512i zx[4];
  for (int c = 0; c < 4; c++) /* column c's zero point in each of its 4 bytes */
    zx[c] = _mm512_mullo_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(zp + 16 * c))),
                               _mm512_set1_epi32(0x01010101));
  for (size_t g = 0; g < bs / 8; g++, codes += 256, out += 512)
    for (int c = 0; c < 4; c++) {
      const __m512i v = _mm512_loadu_si512(codes + 64 * c);
      _mm512_store_si512(out + 64 * c, _mm512_sub_epi8(_mm512_and_si512(v, lo_mask), zx[c]));
      _mm512_store_si512(out + 256 + 64 * c, _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), lo_mask), zx[c]));
    }
}

/* Rows [m0, m1) of one block's int32 dot products (dots: [R, 64], row m0 first) into the line's
   float partial products: part += float(dot - zp * sum(a)) * (scale * x_scale), the VNNI path's
   arithmetic (int4: the zero point is already in the dots). */
static inline void amx_scale(const QJob* j, const int32_t* dots, const void* sc, size_t si, const uint8_t* zp,
                             size_t blk, size_t m0, size_t m1, float* part) {
  const QTiles* t = j->t;
  __m512i z[4];
  __m512 s[4];
  for (int c = 0; c < 4; c++) {
    z[c] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(zp + 16 * c)));
    s[c] = scales16(t, sc, si + 16 * c);
  }
  for (size_t m = m0; m < m1; m++, dots += NR) {
    const __m512 xs = _mm512_set1_ps(j->xs[m * t->blocks + blk]);
    const __m512i nx = _mm512_set1_epi32(-j->xsum[m * t->blocks + blk]);
    float* pr = part + m * NR;
    for (int c = 0; c < 4; c++) {
      __m512i acc = _mm512_load_si512(dots + 16 * c);
      if (t->bits == 8) acc = _mm512_add_epi32(_mm512_mullo_epi32(z[c], nx), acc);
      _mm512_store_ps(pr + 16 * c, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(s[c], xs),
                                                   _mm512_load_ps(pr + 16 * c)));
    }
  }
}

/* Ask for block b of a line's panel (codes cb bytes, its 64 scales of sb bytes each from
   scale si, and its zero points) into L1, if the line has that block. */
static inline void prefetch_block(const uint8_t* codes, const void* sc, size_t si, size_t sb, const uint8_t* zp,
                                  size_t b, size_t nb, size_t cb) {
  if (b >= nb) return;
  const char* pc = (const char*)codes + b * cb;
  for (size_t o = 0; o < cb; o += 64) _mm_prefetch(pc + o, _MM_HINT_T0);
  const char* ps = (const char*)sc + (si + b * NR) * sb;
  for (size_t o = 0; o < NR * sb; o += 64) _mm_prefetch(ps + o, _MM_HINT_T0);
  _mm_prefetch((const char*)(zp + b * NR), _MM_HINT_T0);
}

#ifndef AMX_AHEAD
#define AMX_AHEAD 2 /* int4 blocks unpacked ahead of the one the tiles read */
#endif
#ifndef AMX_LAG
#define AMX_LAG 2 /* units (block, pass) whose dots wait in memory before they are scaled */
#endif
#define AMX_RING 4 /* buffers of unpacked blocks and of dots: > AMX_AHEAD and > AMX_LAG */

/* One task of the AMX path: a run of panels for every token row (layout and numerics above).
   Software-pipelined, since tiles are not renamed and each block's products must leave the C
   tiles before the next block's start: while a unit's tile products run, the vector units unpack
   the int4 block AMX_AHEAD ahead and scale the dots of the unit AMX_LAG behind (rings of
   AMX_RING buffers), and the codes are prefetched AMX_PREFETCH_BYTES ahead (into L1: the tiles
   load from it). */
#ifndef AMX_PREFETCH_BYTES
#define AMX_PREFETCH_BYTES 4096
#endif
static void qtask_amx(void* data, size_t i) {
  const QJob* j = (const QJob*)data;
  const QTiles* t = j->t;
  const size_t q0 = i * j->panels_per_task;
  const size_t q1 = q0 + j->panels_per_task < t->panels ? q0 + j->panels_per_task : t->panels;
  const size_t R = j->amx_rows, passes = (j->M + R - 1) / R, bs = t->bs;
  const size_t kc = bs % 64 == 0 ? 64 : bs % 32 == 0 ? 32 : 16;
  TileConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int u = 0; u < 4; u++) cfg.rows[u] = (uint8_t)R, cfg.colsb[u] = 64;
  for (int u = 4; u < 6; u++) cfg.rows[u] = (uint8_t)R, cfg.colsb[u] = (uint16_t)kc;
  for (int u = 6; u < 8; u++) cfg.rows[u] = (uint8_t)(kc / 4), cfg.colsb[u] = 64;
  float* part = NULL;       /* [M, 64]: one line's partial products for every row */
  uint8_t* unpacked = NULL; /* int4: AMX_RING blocks of codes as int8, [AMX_RING][bs / 4, 256] */
  if (posix_memalign((void**)&part, 64, j->M * NR * sizeof(float)) ||
      (t->bits == 4 && posix_memalign((void**)&unpacked, 64, AMX_RING * bs * NR))) {
    free(part); /* out of memory: the VNNI path needs no buffers */
    for (size_t q = q0; q < q1; q++) {
      size_t m = 0;
      for (; m + QMAXR <= j->M; m += QMAXR) qpanel(j, m, q, QMAXR);
      for (; m < j->M; m++) qpanel(j, m, q, 1);
    }
    return;
  }
  int32_t dots[AMX_RING][16 * NR] __attribute__((aligned(64)));
  __atomic_fetch_add(&amx_tasks, 1, __ATOMIC_RELAXED);
  _tile_loadconfig(&cfg);
  for (size_t q = q0; q < q1; q++) {
    const size_t n0 = q * NR, nc = t->N - n0 < NR ? t->N - n0 : NR;
    size_t blk = 0;
    for (size_t p = 0; p < t->lines; p++) {
      const QLine L = qline(t, p, q);
      const size_t nb = L.nb, s0 = L.s0, sb = t->half ? 2 : 4; /* the panel's first scale, bytes each */
      const uint8_t *w = L.codes, *zp = L.zp;
      const void* sc = L.scales;
      const size_t cb = qblock_bytes(t), pf_ahead = AMX_PREFETCH_BYTES / cb ? AMX_PREFETCH_BYTES / cb : 1;
      memset(part, 0, j->M * NR * sizeof(float));
      for (size_t b = 0; b < AMX_AHEAD && b < nb && t->bits == 4; b++)
        amx_unpack4(w + b * (bs / 8) * 256, zp + b * NR, bs, unpacked + (b % AMX_RING) * bs * NR);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const size_t units = nb * passes; /* unit u: block u / passes, rows of pass u % passes */
      for (size_t u = 0; u < units + AMX_LAG; u++) {
        if (u < units) {
          const size_t b = u / passes, pass = u % passes;
          const uint8_t* bw = t->bits == 4 ? unpacked + (b % AMX_RING) * bs * NR : w + b * (bs / 4) * 256;
          const int8_t* a = j->xqb + ((blk + b) * j->xrows + pass * R) * bs;
          size_t kk = 0;
          if (pass == 0) /* from DRAM: fetch a block a few KB ahead (hardware prefetchers stop at pages) */
            prefetch_block(w, sc, s0, sb, zp, b + pf_ahead, nb, cb);
          if (t->bits == 4) {
            for (; kk + 2 * kc <= bs; kk += 2 * kc) {
              AMX_STEP(4, _tile_dpbssd, kk);
              AMX_STEP(5, _tile_dpbssd, kk + kc);
            }
            if (kk < bs) AMX_STEP(4, _tile_dpbssd, kk);
            const size_t ahead = b + AMX_AHEAD;
            if (pass == 0 && ahead < nb)
              amx_unpack4(w + ahead * (bs / 8) * 256, zp + ahead * NR, bs, unpacked + (ahead % AMX_RING) * bs * NR);
          } else {
            for (; kk + 2 * kc <= bs; kk += 2 * kc) {
              AMX_STEP(4, _tile_dpbsud, kk);
              AMX_STEP(5, _tile_dpbsud, kk + kc);
            }
            if (kk < bs) AMX_STEP(4, _tile_dpbsud, kk);
          }
        }
        if (u >= AMX_LAG) { /* an earlier unit's dots, while this one's products run */
          const size_t v = u - AMX_LAG, b = v / passes, m0 = (v % passes) * R, m1 = m0 + R < j->M ? m0 + R : j->M;
          amx_scale(j, dots[v % AMX_RING], sc, s0 + b * NR, zp + b * NR, blk + b, m0, m1, part);
        }
        if (u < units) {
          int32_t* d = dots[u % AMX_RING];
          _tile_stored(0, d, NR * sizeof(int32_t));
          _tile_stored(1, d + 16, NR * sizeof(int32_t));
          _tile_stored(2, d + 32, NR * sizeof(int32_t));
          _tile_stored(3, d + 48, NR * sizeof(int32_t));
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        }
      }
      /* the chain reduction into y, as the VNNI path (the same float adds) */
      const float* bias = p + 1 == t->lines && t->bias ? t->bias + n0 : NULL;
      const __mmask16 keep[4] = {(__mmask16)(nc >= 16 ? 0xFFFF : (1u << nc) - 1),
                                 (__mmask16)(nc >= 32 ? 0xFFFF : nc <= 16 ? 0 : (1u << (nc - 16)) - 1),
                                 (__mmask16)(nc >= 48 ? 0xFFFF : nc <= 32 ? 0 : (1u << (nc - 32)) - 1),
                                 (__mmask16)(nc >= 64 ? 0xFFFF : nc <= 48 ? 0 : (1u << (nc - 48)) - 1)};
      for (size_t m = 0; m < j->M; m++) {
        float* yr = j->y + m * t->N + n0;
        const float* pr = part + m * NR;
        for (int c = 0; c < 4; c++) {
          __m512 v = _mm512_load_ps(pr + 16 * c);
          if (p) v = _mm512_add_ps(_mm512_maskz_loadu_ps(keep[c], yr + 16 * c), v);
          if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep[c], bias + 16 * c));
          _mm512_mask_storeu_ps(yr + 16 * c, keep[c], v);
        }
      }
      blk += nb;
    }
  }
  _tile_release();
  free(part);
  free(unpacked);
}
#endif

static void qtask(void* data, size_t i) {
  const QJob* j = (const QJob*)data;
  const size_t q0 = i * j->panels_per_task;
  const size_t q1 = q0 + j->panels_per_task < j->t->panels ? q0 + j->panels_per_task : j->t->panels;
  for (size_t q = q0; q < q1; q++) {
#if HAVE_VNNI
    if (j->M > QMAXR && j->M <= QMULTI) {
      qpanel_rows(j, q);
      continue;
    }
#endif
    size_t m = 0;
    for (; m + QMAXR <= j->M; m += QMAXR) qpanel(j, m, q, QMAXR);
    for (; m + 2 <= j->M; m += 2) qpanel(j, m, q, 2);
    for (; m < j->M; m++) qpanel(j, m, q, 1);
  }
}

/* glu: a task's panels (qtask or qtask_amx), then the epilogue on each of them while in cache. */
static void qtask_glu(void* data, size_t i) {
  const QJob* j = (const QJob*)data;
  j->inner(data, i);
  const size_t q0 = i * j->panels_per_task;
  const size_t q1 = q0 + j->panels_per_task < j->t->panels ? q0 + j->panels_per_task : j->t->panels;
  for (size_t q = q0; q < q1; q++) glu_panel(j->t->glu, j->y, j->t->N, j->out, j->t->out_n, j->M, q);
}

/* Check shape, codes, scales and zero points (vals[0..3L]) and point t at their data. */
static OrtStatus* resolve_qtiles(const OrtValue* const* vals, size_t n_vals, int bits, size_t bs, int glu,
                                 QTiles* t) {
  int type = 0;
  size_t rank = 0;
  int64_t d[8];
  memset(t, 0, sizeof *t);
  t->bits = bits;
  t->bs = bs;
  t->half = bits == 4;
  t->glu = glu;
  if (n_vals < 4 || (n_vals - 1) % 3 > 1 || (n_vals - 1) / 3 > MAX_LINES)
    return error("MeshLinearQ: expected x, shape, 1 to %d mesh lines of (codes, scales, zero_points) and an optional "
                 "bias, got %zu inputs", MAX_LINES, n_vals + 1);
  t->lines = (n_vals - 1) / 3;
  TRY(shape_of(vals[0], &type, &rank, d));
  if (type != ELEM_INT64 || rank != 1 || (size_t)d[0] != t->lines + 1)
    return error("MeshLinearQ: shape must be an int64 tensor [%zu] (N and each line's K extent)", t->lines + 1);
  const int64_t* dims = NULL;
  TRY(CALL(GetTensorMutableData, GetTensorMutableDataFn)((OrtValue*)vals[0], (void**)&dims));
  if (dims[0] < 1) return error("MeshLinearQ: N must be positive, got %lld", (long long)dims[0]);
  t->N = t->out_n = (size_t)dims[0];
  if (glu) t->N = glu_columns(t->out_n); /* shape names the F gated outputs; the weights hold gate|up panels */
  t->panels = (t->N + NR - 1) / NR;
  for (size_t p = 0; p < t->lines; p++) {
    if (dims[p + 1] < 1) return error("MeshLinearQ: line %zu's K extent must be positive, got %lld", p, (long long)dims[p + 1]);
    const size_t k = (size_t)dims[p + 1], nb = (k + bs - 1) / bs;
    const size_t want[3][3] = {{t->panels, nb * bs * (size_t)bits / 32, 256}, {t->panels, nb, NR}, {t->panels, nb, NR}};
    const int want_type[3] = {ELEM_UINT8, bits == 4 ? ELEM_FLOAT16 : ELEM_FLOAT, ELEM_UINT8};
    static const char* what[3] = {"codes", "scales", "zero_points"};
    void* data[3];
    for (int i = 0; i < 3; i++) {
      TRY(shape_of(vals[1 + 3 * p + i], &type, &rank, d));
      if (type != want_type[i] || rank != 3 || (size_t)d[0] != want[i][0] || (size_t)d[1] != want[i][1] ||
          (size_t)d[2] != want[i][2])
        return error("MeshLinearQ: line %zu's %s must be a %s tensor [%zu, %zu, %zu] (N=%zu, K extent %zu, block %zu, "
                     "%d bits)", p, what[i], i == 1 ? (bits == 4 ? "float16" : "float") : "uint8", want[i][0], want[i][1], want[i][2], t->N, k,
                     bs, bits);
      TRY(CALL(GetTensorMutableData, GetTensorMutableDataFn)((OrtValue*)vals[1 + 3 * p + i], &data[i]));
    }
    t->codes[p] = data[0];
    t->scales[p] = data[1];
    t->zp[p] = data[2];
    t->k[p] = k;
    t->nb[p] = nb;
    t->K += k;
    t->Kq += nb * bs;
    t->blocks += nb;
  }
  if ((n_vals - 1) % 3 == 1) {
    const OrtValue* b = vals[n_vals - 1];
    TRY(shape_of(b, &type, &rank, d));
    if (type != ELEM_FLOAT || rank != 1 || (size_t)d[0] != t->N)
      return error("MeshLinearQ: bias must be a float tensor [%zu]", t->N);
    TRY(CALL(GetTensorMutableData, GetTensorMutableDataFn)((OrtValue*)b, (void**)&t->bias));
  }
  return NULL;
}

typedef struct {
  int bits, glu, norm;
  float eps;
  size_t bs;
  size_t amx_min_rows; /* token rows from which the AMX path runs (0: never), fixed when the session loads */
  QTiles tiles;        /* resolved at load time when every weight input is a constant initializer */
} QKernel;

/* xdata: the activations to use instead of xv's (the norm prologue's rows; xv gives the shape). */
static OrtStatus* qrun(const QTiles* t, size_t amx_min, OrtKernelContext* ctx, const OrtValue* xv,
                       const float* xdata) {
  QJob j = {.t = t};
  const float* x = NULL;
  TRY(rows_and_output("MeshLinearQ", t->K, t->out_n, ctx, xv, xdata, &x, &j.M, &j.y));
  if (j.M == 0) return NULL;
  /* AMX passes of R rows: the activation rows are zero-padded to whole passes */
  size_t rows = j.M;
#if HAVE_AMX
  if (amx_min && j.M >= amx_min) {
    j.amx_rows = j.M <= 16 ? j.M : 16;
    rows = (j.M + j.amx_rows - 1) / j.amx_rows * j.amx_rows;
  }
#else
  (void)amx_min;
#endif
  /* one allocation: quantised activations (64-byte aligned rows of Kq), then scales and sums */
  const size_t qbytes = (rows * t->Kq + 63) & ~(size_t)63, bbytes = j.amx_rows ? qbytes : 0;
  const size_t gbytes = t->glu ? j.M * t->N * sizeof(float) : 0; /* glu: the gate|up sums */
  char* base = NULL;
  if (posix_memalign((void**)&base, 64,
                     gbytes + qbytes + bbytes + j.M * t->blocks * (sizeof(float) + sizeof(int32_t)) + 64))
    return CALL(CreateStatus, CreateStatusFn)(ORT_FAIL, "MeshLinearQ: out of memory");
  char* buf = base + gbytes; /* gbytes is a multiple of 256: alignment kept */
  if (t->glu) {
    j.out = j.y;
    j.y = (float*)base;
  }
  j.xq = (const int8_t*)buf;
  j.xs = (const float*)(buf + qbytes + bbytes);
  j.xsum = (const int32_t*)(buf + qbytes + bbytes + j.M * t->blocks * sizeof(float));
  quantize_rows(t, x, j.M, (int8_t*)j.xq, (float*)j.xs, (int32_t*)j.xsum);
  memset((int8_t*)j.xq + j.M * t->Kq, 0, (rows - j.M) * t->Kq);
  if (j.amx_rows) { /* block-major for AMX: one block's rows are one contiguous run (an A tile is
                       R x bs bytes in a row instead of R rows Kq bytes apart) */
    int8_t* xqb = (int8_t*)buf + qbytes;
    for (size_t g = 0; g < t->blocks; g++)
      for (size_t r = 0; r < rows; r++) memcpy(xqb + (g * rows + r) * t->bs, j.xq + r * t->Kq + g * t->bs, t->bs);
    j.xqb = xqb;
    j.xrows = rows;
  }
  const size_t tasks = split_tasks(j.M, t->N, t->K, t->panels, &j.panels_per_task); /* whole panels */
  void (*fn)(void*, size_t) = qtask;
#if HAVE_AMX
  if (j.amx_rows) fn = qtask_amx;
#endif
  if (t->glu) {
    j.inner = fn;
    fn = qtask_glu;
  }
  OrtStatus* s = run_tasks(ctx, fn, tasks, &j);
  free(base);
  return s;
}

static OrtStatus* qcompute(void* kernel, OrtKernelContext* ctx) {
  QKernel* k = (QKernel*)kernel;
  size_t n_in = 0;
  const OrtValue* x = NULL;
  TRY(CALL(KernelContext_GetInputCount, GetInputCountFn)(ctx, &n_in));
  TRY(CALL(KernelContext_GetInput, GetInputFn)(ctx, 0, &x));
  QTiles t;
  const QTiles* tp = &k->tiles;
  if (!k->tiles.lines) { /* weights fed at run time (not initializers): check and resolve them for this call */
    const size_t skip = 1 + norm_inputs(k->norm);
    const OrtValue* vals[2 + 3 * MAX_LINES];
    if (n_in < skip + 1 || n_in - skip > 2 + 3 * MAX_LINES)
      return error("MeshLinearQ: expected x, %sshape and 1 to %d mesh lines of (codes, scales, zero_points), got %zu "
                   "inputs", k->norm ? "the norm's inputs, " : "", MAX_LINES, n_in);
    for (size_t i = skip; i < n_in; i++) TRY(CALL(KernelContext_GetInput, GetInputFn)(ctx, i, &vals[i - skip]));
    TRY(resolve_qtiles(vals, n_in - skip, k->bits, k->bs, k->glu, &t));
    tp = &t;
  }
  float* xn = NULL;
  TRY(norm_prologue("MeshLinearQ", k->norm, k->eps, tp->K, ctx, x, &xn));
  OrtStatus* s = qrun(tp, k->amx_min_rows, ctx, x, xn);
  free(xn);
  return s;
}

static OrtStatus* qcreate_kernel(const OrtCustomOp* op, OrtApiTable a, const OrtKernelInfo* info, void** out) {
  (void)op; (void)a;
  size_t n_in = 0;
  int64_t bits = 0, bs = 0;
  TRY(CALL(KernelInfo_GetInputCount, KernelInfoGetInputCountFn)(info, &n_in));
  int norm = NORM_NONE;
  float eps = 0.0f;
  TRY(norm_attributes("MeshLinearQ", info, &norm, &eps));
  const size_t first = 1 + norm_inputs(norm); /* shape's input index */
  if (n_in < first + 4 || (n_in - first - 1) % 3 > 1 || (n_in - first - 1) / 3 > MAX_LINES)
    return error("MeshLinearQ: expected x, %sshape and 1 to %d mesh lines of (codes, scales, zero_points), got %zu "
                 "inputs", norm ? "the norm's inputs, " : "", MAX_LINES, n_in);
  TRY(CALL(KernelInfoGetAttribute_int64, GetAttrInt64Fn)(info, "bits", &bits));
  TRY(CALL(KernelInfoGetAttribute_int64, GetAttrInt64Fn)(info, "block_size", &bs));
  if (bits != 8 && bits != 4) return error("MeshLinearQ: bits must be 8 or 4, got %lld", (long long)bits);
  if (bs < 16 || bs > 4096 || bs % 16) return error("MeshLinearQ: block_size must be a multiple of 16 (16..4096), got %lld", (long long)bs);
  int64_t glu = 0;
  TRY(glu_attribute("MeshLinearQ", info, &glu));
  QKernel* k = calloc(1, sizeof *k);
  if (!k) return CALL(CreateStatus, CreateStatusFn)(ORT_FAIL, "MeshLinearQ: out of memory");
  k->bits = (int)bits;
  k->glu = (int)glu;
  k->norm = norm;
  k->eps = eps;
  k->bs = (size_t)bs;
  k->amx_min_rows = amx_min_rows();
  const OrtValue* vals[2 + 3 * MAX_LINES];
  int all_constant = 1;
  for (size_t i = first; i < n_in && all_constant; i++) {
    int is_const = 0;
    OrtStatus* s = CALL(KernelInfoGetConstantInput_tensor, GetConstantInputFn)(info, i, &is_const, &vals[i - first]);
    if (s) {
      free(k);
      return s;
    }
    all_constant = is_const && vals[i - first];
  }
  if (all_constant) {
    OrtStatus* s = resolve_qtiles(vals, n_in - first, k->bits, k->bs, k->glu, &k->tiles);
    if (s) {
      free(k);
      return s;
    }
  }
  *out = k;
  return NULL;
}

static void qdestroy_kernel(void* kernel) { free(kernel); }
static const char* qop_name(const OrtCustomOp* op) { (void)op; return "MeshLinearQ"; }
static int qinput_type(const OrtCustomOp* op, size_t i) { (void)op; return i == 0 ? ELEM_FLOAT : 0 /* any */; }

static const OrtCustomOp mesh_linear_q = {
    .version = API_VERSION,
    .GetName = qop_name,
    .GetExecutionProviderType = op_provider,
    .GetInputType = qinput_type,
    .GetInputTypeCount = two,
    .GetOutputType = float_type,
    .GetOutputTypeCount = two,
    .KernelDestroy = qdestroy_kernel,
    .GetInputCharacteristic = input_char,
    .GetOutputCharacteristic = output_char,
    .GetInputMemoryType = mem_default,
    .GetVariadicInputMinArity = min_arity,
    .GetVariadicInputHomogeneity = heterogeneous,
    .GetVariadicOutputMinArity = min_arity,
    .GetVariadicOutputHomogeneity = homogeneous,
    .CreateKernelV2 = qcreate_kernel,
    .KernelComputeV2 = qcompute,
};

/* ---- spark.wafer::DecoderAttention: a decoder's causal attention over its KV cache ----
 *
 *   attn, present_key, present_value = DecoderAttention(qkv, k, v, past_key, past_value,
 *                                                       seqlens_k, total_sequence_length, cos, sin)
 *   attributes: num_heads, kv_num_heads, scale
 *
 * The contract of com.microsoft::GroupQueryAttention as the decoder graph uses it (batch 1,
 * do_rotary=1, rotary_interleaved=0), for the S new token rows of one pass:
 *   qkv        float [1, S, (heads + 2 kv_heads) H]: the packed Q|K|V rows; or, with k and v given,
 *              q alone [1, S, heads H] (the qk_norm form: k, v [1, S, kv_heads H])
 *   past_key / past_value  [1, kv_heads, max_len, H], float or float16 (both the same): the cache;
 *              positions [0, past) are valid.  A float16 cache halves the bytes attention reads
 *              per step and the memory a long context holds; the new rows are rounded to half
 *              (nearest even) as they are written, and every read widens them to float, so a
 *              row's keys and values are the same numbers whichever pass wrote them
 *   seqlens_k  int32 [1] = past + S - 1;  total_sequence_length int32 [] = past + S
 *   cos, sin   float [positions, H/2]: the rotate-half RoPE tables (position p's row)
 *   attn       float [1, S, heads H]; present_key / present_value: the cache with the S new rows
 *              written at positions [past, past + S)
 * Query head h reads kv head h / (heads / kv_heads); row s attends causally to positions
 * [0, past + s].  Rotary is applied to the new q and k rows inside the op, the scores are
 * scale * q.k, and the softmax runs in float32 after subtracting the row maximum (as GQA).
 *
 * The runtime binds the same buffer to past and present (engine/runtime.py: KVBuffers), so the
 * new rows are written in place; where ONNX Runtime hands out a separate present buffer the valid
 * past rows are copied into it first, so the result is right either way.
 *
 * Why an op of our own: at a small model's sizes GQA's arithmetic is tiny and its cost is overhead
 * (a thread-pool dispatch per head, a separate rotary pass, generic GEMM calls for one query row).
 * Here a task is a run of (kv head, query row) units: the rows of all query heads sharing a kv head
 * read each cached key and value once, and a decode step's few units run as one task per kv head
 * (or one task in all when the work is small, as run_tasks decides for the linears).
 */
enum { ELEM_INT32 = 6 };

typedef struct {
  int64_t heads, kv_heads;
  float scale;
} AttnKernel;

typedef struct {
  const float *q, *k_in, *v_in; /* row s of query head h at q + s * q_ld + h H (k_in, v_in: kv_ld) */
  size_t q_ld, kv_ld;
  void *key, *value; /* present [kv_heads, max_len, H]: float, or IEEE half floats (half) */
  int half;
  float* out;         /* [S, heads H] */
  const float *cos, *sin;
  size_t S, H, heads, kv_heads, max_len, past, per_task;
  float scale;
} AttnJob;

/* Rotate-half RoPE of one head's row x (H floats) at position pos into y, times mul. */
static inline void rotate(const float* x, float* y, const float* cos, const float* sin, size_t H, float mul) {
  const size_t half = H / 2;
  for (size_t i = 0; i < half; i++) {
    const float x1 = x[i], x2 = x[i + half], c = cos[i] * mul, s = sin[i] * mul;
    y[i] = x1 * c - x2 * s;
    y[i + half] = x2 * c + x1 * s;
  }
}

/* The IEEE half float nearest f (ties to even; overflow to infinity, NaN kept): the portable
   path's store into a half cache (AVX-512 and F16C use vcvtps2ph, which rounds the same way). */
static inline uint16_t half_bits(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  x &= 0x7FFFFFFFu;
  if (x >= 0x7F800000u) return sign | 0x7C00u | (x > 0x7F800000u ? 0x200u : 0); /* inf, NaN */
  if (x >= 0x477FF000u) return sign | 0x7C00u; /* rounds past 65504: infinity */
  if (x < 0x38800000u) { /* below 2^-14: a subnormal half, m * 2^-24 */
    if (x < 0x33000000u) return sign; /* below 2^-25: zero */
    const uint32_t e = x >> 23, m = (x & 0x7FFFFFu) | 0x800000u, shift = 126 - e;
    uint32_t h = m >> shift;
    const uint32_t rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rest > half || (rest == half && (h & 1u))) h++;
    return sign | (uint16_t)h;
  }
  uint32_t h = ((x >> 13) - (112u << 10)) & 0xFFFFu; /* rebias 127 -> 15, keep 10 mantissa bits */
  const uint32_t rest = x & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++; /* a carry rolls into the exponent */
  return sign | (uint16_t)h;
}

/* 16 floats of a cache at element i: float, or half floats widened (exactly). */
static inline __attribute__((always_inline)) v16 kv_ld(const void* base, size_t i, const int half) {
  if (!half) return ld((const float*)base + i);
#if defined(__AVX512F__)
  return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)base + i)));
#elif defined(__F16C__) /* AVX2 machines: eight at a time */
  const __m128i* h = (const __m128i*)((const uint16_t*)base + i);
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(h)), hi = _mm256_cvtph_ps(_mm_loadu_si128(h + 1));
  v16 v;
  memcpy(&v, &lo, sizeof lo);
  memcpy((char*)&v + sizeof lo, &hi, sizeof hi);
  return v;
#else
  v16 v;
  const uint16_t* h = (const uint16_t*)base + i;
  for (int l = 0; l < 16; l++) v[l] = half_value(h[l]);
  return v;
#endif
}

/* One head row (H floats, H a multiple of 16) into a cache at element i, rounded to half where
   the cache holds halves. */
static inline void kv_store_row(void* base, size_t i, const float* row, size_t H, int half) {
  if (!half) {
    memcpy((float*)base + i, row, H * sizeof(float));
    return;
  }
  uint16_t* out = (uint16_t*)base + i;
#if defined(__AVX512F__)
  for (size_t c = 0; c < H; c += 16)
    _mm256_storeu_si256((__m256i*)(out + c),
                        _mm512_cvtps_ph(_mm512_loadu_ps(row + c), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__)
  for (size_t c = 0; c < H; c += 8)
    _mm_storeu_si128((__m128i*)(out + c),
                     _mm256_cvtps_ph(_mm256_loadu_ps(row + c), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  for (size_t c = 0; c < H; c++) out[c] = half_bits(row[c]);
#endif
}

#ifndef ATTN_ROWS
#define ATTN_ROWS 4 /* query rows per unit: their query heads share each key and value read */
#endif

#if defined(__AVX512F__)
/* r[0..16) <- its transpose (lane j of r[i] <- lane i of r[j]): the classic 4-stage 16 x 16. */
static inline __attribute__((always_inline)) void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; i++) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; i++) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

/* ROWS query rows q[r H ..] against one block of keys kt (transposed: [H][16], key i in lane
   i): sc[r ld + i] = q_r . k_i, a sequential sum over the head's dimensions per (row, key). */
static inline __attribute__((always_inline)) void scores_rows(const float* kt, const float* q, size_t H, float* sc,
                                                              size_t ld, const int ROWS) {
  __m512 acc[8];
  for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
  for (size_t d = 0; d < H; d++) {
    const __m512 k = _mm512_load_ps(kt + d * 16);
    for (int r = 0; r < ROWS; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * H + d]), k, acc[r]);
  }
  for (int r = 0; r < ROWS; r++) _mm512_storeu_ps(sc + r * ld, acc[r]);
}

/* The scores of n query vectors (qr, H apart) for the `keys` <= 16 keys at K into sc[r ld_sc ..]:
   the block is transposed once and shared by every row, so a pass of many rows (a prefill, a
   speculative verification) pays no per-row reduction; lanes past `keys` are zeros and their
   scores unused.  Each (row, key) is summed the same way whatever the other rows, so a row's
   scores do not depend on the pass it is in. */
static inline __attribute__((always_inline)) void scores_block(const void* K, size_t t0, size_t keys, size_t H,
                                                               const float* qr, size_t n, float* sc, size_t ld_sc,
                                                               const int half) {
  float kt[128 * 16] __attribute__((aligned(64))); /* H <= 128 (attn_compute checks it) */
  for (size_t c = 0; c < H; c += 16) {
    __m512 r[16];
    for (size_t i = 0; i < 16; i++) r[i] = i < keys ? (__m512)kv_ld(K, (t0 + i) * H + c, half) : _mm512_setzero_ps();
    transpose16(r);
    for (size_t i = 0; i < 16; i++) _mm512_store_ps(kt + (c + i) * 16, r[i]);
  }
  size_t r = 0;
  for (; r + 8 <= n; r += 8) scores_rows(kt, qr + r * H, H, sc + r * ld_sc, ld_sc, 8);
  const float* q = qr + r * H;
  float* out = sc + r * ld_sc;
  switch (n - r) { /* the rest: a row count known to the compiler, so the sums stay in registers */
    case 7: scores_rows(kt, q, H, out, ld_sc, 7); break;
    case 6: scores_rows(kt, q, H, out, ld_sc, 6); break;
    case 5: scores_rows(kt, q, H, out, ld_sc, 5); break;
    case 4: scores_rows(kt, q, H, out, ld_sc, 4); break;
    case 3: scores_rows(kt, q, H, out, ld_sc, 3); break;
    case 2: scores_rows(kt, q, H, out, ld_sc, 2); break;
    case 1: scores_rows(kt, q, H, out, ld_sc, 1); break;
    default: break;
  }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ATTN_AVX2 1
/* AVX2's form of the above: r[0..8) <- its 8 x 8 transpose (lane j of r[i] <- lane i of r[j]). */
static inline __attribute__((always_inline)) void transpose8(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; i++) {
    t[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
    t[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
  }
  for (int i = 0; i < 8; i++) r[i] = t[i];
}

/* 8 floats of a cache at element i: float, or half floats widened (exactly). */
static inline __m256 kv_ld8(const void* base, size_t i, const int half) {
  return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)base + i)))
              : _mm256_loadu_ps((const float*)base + i);
}

/* As the AVX-512 scores_rows: 16 keys in two registers, ROWS <= 6 rows (12 sums). */
static inline __attribute__((always_inline)) void scores_rows(const float* kt, const float* q, size_t H, float* sc,
                                                              size_t ld, const int ROWS) {
  __m256 acc[6][2];
  for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (size_t d = 0; d < H; d++) {
    const __m256 k0 = _mm256_load_ps(kt + d * 16), k1 = _mm256_load_ps(kt + d * 16 + 8);
    for (int r = 0; r < ROWS; r++) {
      const __m256 x = _mm256_set1_ps(q[r * H + d]);
      acc[r][0] = _mm256_fmadd_ps(x, k0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, k1, acc[r][1]);
    }
  }
  for (int r = 0; r < ROWS; r++) {
    _mm256_storeu_ps(sc + r * ld, acc[r][0]);
    _mm256_storeu_ps(sc + r * ld + 8, acc[r][1]);
  }
}

/* As the AVX-512 scores_block (the same sums per (row, key), so the same scores): the block's
   keys transposed 8 x 8 at a time, rows 6 at a time. */
static inline __attribute__((always_inline)) void scores_block(const void* K, size_t t0, size_t keys, size_t H,
                                                               const float* qr, size_t n, float* sc, size_t ld_sc,
                                                               const int half) {
  float kt[128 * 16] __attribute__((aligned(32))); /* H <= 128 (attn_compute checks it) */
  for (size_t c = 0; c < H; c += 8)
    for (size_t h = 0; h < 16; h += 8) {
      __m256 r[8];
      for (size_t i = 0; i < 8; i++) r[i] = h + i < keys ? kv_ld8(K, (t0 + h + i) * H + c, half) : _mm256_setzero_ps();
      transpose8(r);
      for (size_t i = 0; i < 8; i++) _mm256_store_ps(kt + (c + i) * 16 + h, r[i]);
    }
  size_t r = 0;
  for (; r + 6 <= n; r += 6) scores_rows(kt, qr + r * H, H, sc + r * ld_sc, ld_sc, 6);
  const float* q = qr + r * H;
  float* out = sc + r * ld_sc;
  switch (n - r) {
    case 5: scores_rows(kt, q, H, out, ld_sc, 5); break;
    case 4: scores_rows(kt, q, H, out, ld_sc, 4); break;
    case 3: scores_rows(kt, q, H, out, ld_sc, 3); break;
    case 2: scores_rows(kt, q, H, out, ld_sc, 2); break;
    case 1: scores_rows(kt, q, H, out, ld_sc, 1); break;
    default: break;
  }
}
#else
/* q . k for the 16 keys from position t0 of the cache K (H apart) into sc[0..16). */
static inline __attribute__((always_inline)) void scores16(const float* q, const void* K, size_t t0, size_t H,
                                                           float* sc, const size_t NV, const int half) {
  for (size_t t = 0; t < 16; t++) {
    const size_t k = (t0 + t) * H;
    v16 s = ld(q) * kv_ld(K, k, half);
    for (size_t c = 1; c < NV; c++) s += ld(q + 16 * c) * kv_ld(K, k + 16 * c, half);
    sc[t] = hsum(s);
  }
}
#endif

/* out[q] = inv[q] sum_t p[q][t] V[t] for NQ query vectors sharing T (NQ <= 4, NQ NV <= 16 sums in
   registers): each value row is read, and from a half cache widened, once for all of them.  One
   vector alone sums even and odd t in two chains (FMA latency, not throughput, bounds one chain)
   and adds them; several sum t in order.  Which heads go together depends on the group size
   alone (attn_unit), so a row's numbers do not depend on the other rows of its pass. */
static inline __attribute__((always_inline)) void weigh_values(const void* V, size_t T, size_t H, float* const* p,
                                                               const float* inv, float* const* out, const size_t NV,
                                                               const int half, const int NQ) {
  v16 a[4][8];
  for (int q = 0; q < NQ; q++)
    for (size_t c = 0; c < NV; c++) a[q][c] = bc(0.0f);
  if (NQ > 1) {
    for (size_t t = 0; t < T; t++) {
      for (size_t c = 0; c < NV; c++) {
        const v16 v = kv_ld(V, t * H + 16 * c, half);
        for (int q = 0; q < NQ; q++) a[q][c] += bc(p[q][t]) * v;
      }
    }
  } else {
    v16* a0 = a[0];
    v16* a1 = a[1];
    for (size_t c = 0; c < NV; c++) a1[c] = bc(0.0f);
    size_t t = 0;
    for (; t + 1 < T; t += 2) {
      const v16 w0 = bc(p[0][t]), w1 = bc(p[0][t + 1]);
      for (size_t c = 0; c < NV; c++) {
        a0[c] += w0 * kv_ld(V, t * H + 16 * c, half);
        a1[c] += w1 * kv_ld(V, (t + 1) * H + 16 * c, half);
      }
    }
    if (t < T)
      for (size_t c = 0; c < NV; c++) a0[c] += bc(p[0][t]) * kv_ld(V, t * H + 16 * c, half);
    for (size_t c = 0; c < NV; c++) a0[c] += a1[c];
  }
  for (int q = 0; q < NQ; q++)
    for (size_t c = 0; c < NV; c++) st(out[q] + 16 * c, a[q][c] * bc(inv[q]));
}

#if defined(__AVX512F__)
/* glu_exp on 16 lanes (the same Cephes polynomial and clamp). */
static inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 magic = _mm512_set1_ps(12582912.0f);
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), magic), magic);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

#if defined(ATTN_AVX2)
/* glu_exp on 8 lanes (the same polynomial and clamp as exp16). */
static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 magic = _mm256_set1_ps(12582912.0f);
  const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), magic), magic);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

/* p[0..T) = exp(p - max p) in place; returns their sum (float32, max-subtracted, as GQA). */
static inline float softmax(float* p, size_t T) {
  size_t t = 0;
  float m = p[0], sum = 0.0f;
#if defined(__AVX512F__)
  if (T >= 16) {
    __m512 mv = _mm512_loadu_ps(p);
    for (t = 16; t + 16 <= T; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(p + t));
    m = _mm512_reduce_max_ps(mv);
  }
  for (; t < T; t++) m = p[t] > m ? p[t] : m;
  const __m512 mb = _mm512_set1_ps(m);
  __m512 sv = _mm512_setzero_ps();
  for (t = 0; t + 16 <= T; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p + t), mb));
    _mm512_storeu_ps(p + t, e);
    sv = _mm512_add_ps(sv, e);
  }
  sum = _mm512_reduce_add_ps(sv);
#elif defined(ATTN_AVX2) /* the same, 8 lanes at a time */
  if (T >= 8) {
    __m256 mv = _mm256_loadu_ps(p);
    for (t = 8; t + 8 <= T; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(p + t));
    float lanes[8];
    _mm256_storeu_ps(lanes, mv);
    for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
  }
  for (; t < T; t++) m = p[t] > m ? p[t] : m;
  const __m256 mb = _mm256_set1_ps(m);
  __m256 sv = _mm256_setzero_ps();
  for (t = 0; t + 8 <= T; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + t), mb));
    _mm256_storeu_ps(p + t, e);
    sv = _mm256_add_ps(sv, e);
  }
  float sums[8];
  _mm256_storeu_ps(sums, sv);
  for (int l = 0; l < 8; l++) sum += sums[l];
#else
  for (t = 1; t < T; t++) m = p[t] > m ? p[t] : m;
  t = 0;
#endif
  for (; t < T; t++) {
    p[t] = glu_exp(p[t] - m);
    sum += p[t];
  }
  return sum;
}

/* One unit: query rows [s0, s1) of the G query heads that share kv head g.  Query vector
   r = (s - s0) G + h attends to positions [0, past + s]. */
static inline __attribute__((always_inline)) void attn_unit(const AttnJob* j, size_t g, size_t s0, size_t s1,
                                                            float* qr, float* sc, size_t ld_sc, const size_t NV,
                                                            const int half) {
  const size_t H = j->H, G = j->heads / j->kv_heads, n = (s1 - s0) * G, es = half ? 2 : 4;
  const void* K = (const char*)j->key + g * j->max_len * H * es;
  const void* V = (const char*)j->value + g * j->max_len * H * es;
  size_t T[ATTN_ROWS * 64];
  for (size_t s = s0; s < s1; s++) {
    const size_t pos = j->past + s;
    for (size_t h = 0; h < G; h++) {
      T[(s - s0) * G + h] = pos + 1;
      rotate(j->q + s * j->q_ld + (g * G + h) * H, qr + ((s - s0) * G + h) * H, j->cos + pos * (H / 2),
             j->sin + pos * (H / 2), H, j->scale);
    }
  }
  const size_t tmax = j->past + s1;
  for (size_t t0 = 0; t0 < tmax; t0 += 16) /* scores: each block of keys read once for the unit */
#if defined(__AVX512F__) || defined(ATTN_AVX2)
    scores_block(K, t0, tmax - t0 < 16 ? tmax - t0 : 16, H, qr, n, sc + t0, ld_sc, half);
#else
    for (size_t r = 0; r < n; r++) {
      if (t0 + 16 <= T[r]) {
        scores16(qr + r * H, K, t0, H, sc + r * ld_sc + t0, NV, half);
      } else {
        for (size_t t = t0; t < T[r]; t++) {
          v16 a = ld(qr + r * H) * kv_ld(K, t * H, half);
          for (size_t c = 1; c < NV; c++) a += ld(qr + r * H + 16 * c) * kv_ld(K, t * H + 16 * c, half);
          sc[r * ld_sc + t] = hsum(a);
        }
      }
    }
#endif
  float inv[ATTN_ROWS * 64];
  for (size_t r = 0; r < n; r++) inv[r] = 1.0f / softmax(sc + r * ld_sc, T[r]);
  const size_t QN = NV <= 4 ? 4 : 2; /* query vectors per pass over V (their sums fit the registers) */
  for (size_t s = s0; s < s1; s++)    /* each row's heads in runs of QN: the same runs in every pass */
    for (size_t h = 0; h < G; h += QN) {
      const size_t r = (s - s0) * G + h, nq = G - h < QN ? G - h : QN;
      float* ps[4];
      float* os[4];
      for (size_t q = 0; q < nq; q++) {
        ps[q] = sc + (r + q) * ld_sc;
        os[q] = j->out + s * j->heads * H + (g * G + h + q) * H;
      }
      switch (nq) {
        case 4: weigh_values(V, T[r], H, ps, inv + r, os, NV, half, 4); break;
        case 3: weigh_values(V, T[r], H, ps, inv + r, os, NV, half, 3); break;
        case 2: weigh_values(V, T[r], H, ps, inv + r, os, NV, half, 2); break;
        default: weigh_values(V, T[r], H, ps, inv + r, os, NV, half, 1); break;
      }
    }
}

/* attn_unit specialised per head size (16, 32, 64: nv = H / 16 a constant) and cache type, and for
   any other head size, each a function of its own: inlined into one function (a switch over
   them), the eight copies took the compiler 2.5 times as long, on every machine's first load. */
#define ATTN_UNIT_PARAMS \
  const AttnJob *j, size_t g, size_t s0, size_t s1, float *qr, float *sc, size_t ld_sc, size_t nv
#define ATTN_UNIT(u, NV, HALF) \
  static void attn_unit_##u(ATTN_UNIT_PARAMS) { (void)nv; attn_unit(j, g, s0, s1, qr, sc, ld_sc, NV, HALF); }
ATTN_UNIT(0, 1, 0)
ATTN_UNIT(1, 1, 1)
ATTN_UNIT(2, 2, 0)
ATTN_UNIT(3, 2, 1)
ATTN_UNIT(4, 4, 0)
ATTN_UNIT(5, 4, 1)
ATTN_UNIT(6, nv, 0)
ATTN_UNIT(7, nv, 1)
static void (*const attn_units[8])(ATTN_UNIT_PARAMS) = {attn_unit_0, attn_unit_1, attn_unit_2, attn_unit_3,
                                                       attn_unit_4, attn_unit_5, attn_unit_6, attn_unit_7};
static inline size_t attn_unit_index(size_t nv, int half) {
  const size_t h = half != 0;
  return nv == 1 ? h : nv == 2 ? 2 + h : nv == 4 ? 4 + h : 6 + h;
}

/* Units [i per_task, (i + 1) per_task) of kv_heads x row blocks, head-major. */
static void attn_task(void* data, size_t i) {
  const AttnJob* j = (const AttnJob*)data;
  const size_t H = j->H, G = j->heads / j->kv_heads, nv = H / 16;
  const size_t blocks = (j->S + ATTN_ROWS - 1) / ATTN_ROWS, units = j->kv_heads * blocks;
  size_t u = i * j->per_task, end = u + j->per_task;
  if (end > units) end = units;
  const size_t ld_sc = (j->past + j->S + 15) & ~(size_t)15;
  float* scratch = NULL; /* rotated queries [ATTN_ROWS G, H], score rows [ATTN_ROWS G, ld_sc] */
  if (posix_memalign((void**)&scratch, 64, ATTN_ROWS * G * (H + ld_sc) * sizeof(float))) return;
  for (; u < end; u++) {
    const size_t g = u / blocks, s0 = (u % blocks) * ATTN_ROWS;
    const size_t s1 = s0 + ATTN_ROWS < j->S ? s0 + ATTN_ROWS : j->S;
    float* sc = scratch + ATTN_ROWS * G * H;
    attn_units[attn_unit_index(nv, j->half)](j, g, s0, s1, scratch, sc, ld_sc, nv);
  }
  free(scratch);
}

static OrtStatus* attn_input(OrtKernelContext* ctx, size_t i, const OrtValue** v) {
  return CALL(KernelContext_GetInput, GetInputFn)(ctx, i, v);
}

static OrtStatus* attn_compute(void* kernel, OrtKernelContext* ctx) {
  const AttnKernel* k = (const AttnKernel*)kernel;
  const OrtValue* in[9] = {0};
  size_t n_in = 0;
  TRY(CALL(KernelContext_GetInputCount, GetInputCountFn)(ctx, &n_in));
  if (n_in != 9) return error("DecoderAttention: expected 9 inputs, got %zu", n_in);
  for (size_t i = 0; i < 9; i++) TRY(attn_input(ctx, i, &in[i]));
  const int packed = !in[1] && !in[2];
  if (!in[0] || (!packed && !(in[1] && in[2])) || !in[3] || !in[4] || !in[5] || !in[7] || !in[8])
    return error("DecoderAttention: qkv (or q, k and v), past key/value, seqlens_k, cos and sin are required");
  int type = 0;
  size_t rank = 0;
  int64_t xd[8], pd[8], vd[8], cd[8], sd[8], ld_[8];
  AttnJob j = {.heads = (size_t)k->heads, .kv_heads = (size_t)k->kv_heads, .scale = k->scale};
  TRY(shape_of(in[3], &type, &rank, pd));
  const int cache_type = type;
  if ((type != ELEM_FLOAT && type != ELEM_FLOAT16) || rank != 4 || pd[0] != 1 || pd[1] != k->kv_heads ||
      pd[3] % 16 || pd[3] == 0 || pd[3] > 128)
    return error("DecoderAttention: past_key must be float or float16 [1, kv_num_heads, max_len, H], "
                 "H 16, 32, ... or 128");
  TRY(shape_of(in[4], &type, &rank, vd));
  if (type != cache_type || rank != 4 || memcmp(vd, pd, sizeof(int64_t) * 4))
    return error("DecoderAttention: past_value must have past_key's type and shape");
  j.half = cache_type == ELEM_FLOAT16;
  const size_t es = j.half ? 2 : 4; /* bytes per cached element */
  j.max_len = (size_t)pd[2];
  j.H = (size_t)pd[3];
  const size_t H = j.H, qw = j.heads * H, kw = j.kv_heads * H;
  TRY(shape_of(in[0], &type, &rank, xd));
  if (type != ELEM_FLOAT || rank != 3 || xd[0] != 1 || (size_t)xd[2] != (packed ? qw + 2 * kw : qw))
    return error("DecoderAttention: %s must be float [1, S, %zu]", packed ? "qkv" : "q", packed ? qw + 2 * kw : qw);
  j.S = (size_t)xd[1];
  TRY(CALL(GetTensorMutableData, GetTensorMutableDataFn)((OrtValue*)in[0], (void**)&j.q));
  if (packed) {
    j.q_ld = j.kv_ld = qw + 2 * kw;
    j.k_in = j.q + qw;
    j.v_in = j.q + qw + kw;
  } else {
    for (size_t i = 1; i <= 2; i++) {
      TRY(shape_of(in[i], &type, &rank, xd));
      if (type != ELEM_FLOAT || rank != 3 || xd[0] != 1 || (size_t)xd[1] != j.S || (size_t)xd[2] != kw)
        return error("DecoderAttention: k and v must be float [1, S, %zu]", kw);
    }
    TRY(CALL(GetTensorMutableData, GetTensorMutableDataFn)((OrtValue*)in[1], (void**)&j.k_in));
    TRY(CALL(GetTensorMutableData, GetTensorMutableDataFn)((OrtValue*)in[2], (void**)&j.v_in));
    j.q_ld = qw;
    j.kv_ld = kw;
  }
  const int32_t* seqlens = NULL;
  TRY(shape_of(in[5], &type, &rank, sd));
  if (type != ELEM_INT32 || rank != 1 || sd[0] != 1) return error("DecoderAttention: seqlens_k must be int32 [1]");
  TRY(CALL(GetTensorMutableData, GetTensorMutableDataFn)((OrtValue*)in[5], (void**)&seqlens));
  const int64_t total = (int64_t)seqlens[0] + 1;
  if (total < (int64_t)j.S || total > (int64_t)j.max_len)
    return error("DecoderAttention: seqlens_k + 1 = %lld must lie in [S, max_len] = [%zu, %zu]", (long long)total, j.S,
                 j.max_len);
  j.past = (size_t)total - j.S;
  for (size_t i = 7; i <= 8; i++) {
    TRY(shape_of(in[i], &type, &rank, i == 7 ? cd : ld_));
    const int64_t* d = i == 7 ? cd : ld_;
    if (type != ELEM_FLOAT || rank != 2 || (size_t)d[1] != H / 2 || d[0] < total)
      return error("DecoderAttention: cos and sin must be float [>= %lld positions, %zu]", (long long)total, H / 2);
  }
  TRY(CALL(GetTensorMutableData, GetTensorMutableDataFn)((OrtValue*)in[7], (void**)&j.cos));
  TRY(CALL(GetTensorMutableData, GetTensorMutableDataFn)((OrtValue*)in[8], (void**)&j.sin));
  void *past_k = NULL, *past_v = NULL;
  TRY(CALL(GetTensorMutableData, GetTensorMutableDataFn)((OrtValue*)in[3], (void**)&past_k));
  TRY(CALL(GetTensorMutableData, GetTensorMutableDataFn)((OrtValue*)in[4], (void**)&past_v));

  OrtValue *out = NULL, *pk = NULL, *pv = NULL;
  const int64_t od[3] = {1, (int64_t)j.S, (int64_t)qw};
  TRY(CALL(KernelContext_GetOutput, GetOutputFn)(ctx, 0, od, 3, &out));
  TRY(CALL(KernelContext_GetOutput, GetOutputFn)(ctx, 1, pd, 4, &pk));
  TRY(CALL(KernelContext_GetOutput, GetOutputFn)(ctx, 2, pd, 4, &pv));
  TRY(CALL(GetTensorMutableData, GetTensorMutableDataFn)(out, (void**)&j.out));
  TRY(CALL(GetTensorMutableData, GetTensorMutableDataFn)(pk, (void**)&j.key));
  TRY(CALL(GetTensorMutableData, GetTensorMutableDataFn)(pv, (void**)&j.value));
  const size_t head = j.max_len * H;
  for (size_t g = 0; g < j.kv_heads; g++) { /* a fresh present buffer: the valid past rows first */
    if (j.key != past_k) memcpy((char*)j.key + g * head * es, (char*)past_k + g * head * es, j.past * H * es);
    if (j.value != past_v) memcpy((char*)j.value + g * head * es, (char*)past_v + g * head * es, j.past * H * es);
  }
  for (size_t s = 0; s < j.S; s++) { /* the new rows: keys rotated, values as they are */
    const size_t pos = j.past + s;
    for (size_t g = 0; g < j.kv_heads; g++) {
      float k_row[128] __attribute__((aligned(64)));
      rotate(j.k_in + s * j.kv_ld + g * H, k_row, j.cos + pos * (H / 2), j.sin + pos * (H / 2), H, 1.0f);
      kv_store_row(j.key, g * head + pos * H, k_row, H, j.half);
      kv_store_row(j.value, g * head + pos * H, j.v_in + s * j.kv_ld + g * H, H, j.half);
    }
  }
  if (j.S == 0) return NULL;
  /* a unit: ATTN_ROWS rows x G heads x ~(past + S/2) positions x H x 2 multiply-adds */
  const size_t units = j.kv_heads * ((j.S + ATTN_ROWS - 1) / ATTN_ROWS);
  const size_t tasks = split_tasks(j.kv_heads * j.S, j.heads / j.kv_heads * (j.past + (j.S + 1) / 2), 2 * H,
                                   units, &j.per_task);
  return run_tasks(ctx, attn_task, tasks, &j);
}

static OrtStatus* attn_create_kernel(const OrtCustomOp* op, OrtApiTable a, const OrtKernelInfo* info, void** out) {
  (void)op; (void)a;
  int64_t heads = 0, kv_heads = 0;
  float scale = 0.0f;
  TRY(CALL(KernelInfoGetAttribute_int64, GetAttrInt64Fn)(info, "num_heads", &heads));
  TRY(CALL(KernelInfoGetAttribute_int64, GetAttrInt64Fn)(info, "kv_num_heads", &kv_heads));
  TRY(CALL(KernelInfoGetAttribute_float, GetAttrFloatFn)(info, "scale", &scale));
  if (heads <= 0 || kv_heads <= 0 || heads % kv_heads || heads / kv_heads > 64)
    return error("DecoderAttention: num_heads (%lld) must be 1 to 64 times kv_num_heads (%lld)",
                 (long long)heads, (long long)kv_heads);
  AttnKernel* k = calloc(1, sizeof *k);
  if (!k) return CALL(CreateStatus, CreateStatusFn)(ORT_FAIL, "DecoderAttention: out of memory");
  k->heads = heads;
  k->kv_heads = kv_heads;
  k->scale = scale;
  *out = k;
  return NULL;
}

static const char* attn_name(const OrtCustomOp* op) { (void)op; return "DecoderAttention"; }
/* Two registrations under one name, one per cache type (ONNX Runtime picks the kernel by the
   types the graph gives past key/value and present key/value); one compute serves both. */
static int attn_input_type(const OrtCustomOp* op, size_t i) { (void)op; return i == 5 || i == 6 ? ELEM_INT32 : ELEM_FLOAT; }
static int attn_input_type_half(const OrtCustomOp* op, size_t i) {
  (void)op;
  return i == 5 || i == 6 ? ELEM_INT32 : i == 3 || i == 4 ? ELEM_FLOAT16 : ELEM_FLOAT;
}
static int attn_output_type_half(const OrtCustomOp* op, size_t i) { (void)op; return i == 0 ? ELEM_FLOAT : ELEM_FLOAT16; }
static size_t nine(const OrtCustomOp* op) { (void)op; return 9; }
static size_t three(const OrtCustomOp* op) { (void)op; return 3; }
/* k and v (the qk_norm form) and total_sequence_length (implied by seqlens_k) are optional */
static int attn_input_char(const OrtCustomOp* op, size_t i) {
  (void)op;
  return i == 1 || i == 2 || i == 6 ? CHAR_OPTIONAL : CHAR_REQUIRED;
}
static int required(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return CHAR_REQUIRED; }

static const OrtCustomOp decoder_attention = {
    .version = API_VERSION,
    .GetName = attn_name,
    .GetExecutionProviderType = op_provider,
    .GetInputType = attn_input_type,
    .GetInputTypeCount = nine,
    .GetOutputType = float_type,
    .GetOutputTypeCount = three,
    .KernelDestroy = destroy_kernel,
    .GetInputCharacteristic = attn_input_char,
    .GetOutputCharacteristic = required,
    .GetInputMemoryType = mem_default,
    .GetVariadicInputMinArity = min_arity,
    .GetVariadicInputHomogeneity = heterogeneous,
    .GetVariadicOutputMinArity = min_arity,
    .GetVariadicOutputHomogeneity = homogeneous,
    .CreateKernelV2 = attn_create_kernel,
    .KernelComputeV2 = attn_compute,
};

/* The same op over a float16 cache: decoder_attention's entries with these types (make_domain). */
static OrtCustomOp decoder_attention_half;

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
  if (!domain_error) domain_error = CALL(CustomOpDomain_Add, CustomOpDomainAddFn)(domain, &mesh_linear_q);
  if (!domain_error) domain_error = CALL(CustomOpDomain_Add, CustomOpDomainAddFn)(domain, &decoder_attention);
  decoder_attention_half = decoder_attention;
  decoder_attention_half.GetInputType = attn_input_type_half;
  decoder_attention_half.GetOutputType = attn_output_type_half;
  if (!domain_error) domain_error = CALL(CustomOpDomain_Add, CustomOpDomainAddFn)(domain, &decoder_attention_half);
}

__attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                   const OrtApiBase* base) {
  api_base = base;
  pthread_once(&domain_once, make_domain);
  if (!api) return NULL; /* older than 1.20: mesh_op.py never loads it there */
  if (domain_error) return CALL(CreateStatus, CreateStatusFn)(ORT_FAIL, "MeshLinear: could not register spark.wafer");
  return CALL(AddCustomOpDomain, AddCustomOpDomainFn)(options, domain);
}
