/* hyperagent's NCCL tuner plugin: the AllReduce algorithm, protocol, channels and pipeline
 * chunk that hyperagent_nccl_select* chose, applied to every AllReduce NCCL plans.
 *
 * NCCL (NCCL_TUNER_PLUGIN=<this library>) loads the newest interface it knows of
 * ncclTunerPlugin_v6 .. _v3 and calls getCollInfo on the host for every collective, with a
 * contiguous float[numAlgo][numProto] cost table: NCCL takes the smallest entry that is >= 0,
 * unsupported entries are NCCL_ALGO_PROTO_IGNORE (-1). For AllReduce this plugin sets the chosen
 * entry to 0.0 when it is supported and otherwise leaves the table as NCCL gave it, counting a
 * fallback. The Python side (hyperagent.nccl) loads the same file, so both see one state; the
 * choice is one atomic word, read once per call, so a call never mixes two choices.
 */
#include <stdatomic.h>
#include <stdint.h>

#include "nccl_tuner.h"

#define EXPORT __attribute__((visibility("default")))
#define MAX_CHANNELS 64
#define NO_CHOICE (-1)

/* (algorithm + 1) | (protocol + 1) << 8 | channels << 16 */
static _Atomic uint64_t choice = 0;
static _Atomic uint64_t generation = 0;
static _Atomic uint64_t logged_generation = 0;
static _Atomic unsigned long long chunk_bytes = 0;
static _Atomic unsigned long long fallbacks = 0;
static _Atomic unsigned int offered = 0;
static _Atomic int loaded_version = 0;

struct context {
  ncclDebugLogger_t log;
  size_t ranks;
  size_t nodes;
};
static struct context shared_contexts[1];

static uint64_t pack(int algorithm, int protocol, int channels) {
  return (uint64_t)(algorithm + 1) | (uint64_t)(protocol + 1) << 8 | (uint64_t)channels << 16;
}

EXPORT int hyperagent_nccl_select(int algorithm, int protocol, int channels) {
  if (algorithm < NO_CHOICE || algorithm >= NCCL_NUM_ALGORITHMS) return -1;
  if (protocol < NO_CHOICE || protocol >= NCCL_NUM_PROTOCOLS) return -1;
  if (channels < 0 || channels > MAX_CHANNELS) return -1;
  uint64_t next = pack(algorithm, protocol, channels);
  if (atomic_exchange(&choice, next) != next) atomic_fetch_add(&generation, 1);
  return 0;
}

EXPORT int hyperagent_nccl_selected(int* algorithm, int* protocol, int* channels) {
  uint64_t now = atomic_load(&choice);
  *algorithm = (int)(now & 0xff) - 1;
  *protocol = (int)(now >> 8 & 0xff) - 1;
  *channels = (int)(now >> 16 & 0xffff);
  return 0;
}

EXPORT int hyperagent_nccl_select_chunk(unsigned long long bytes) {
  atomic_store(&chunk_bytes, bytes);
  return 0;
}

EXPORT unsigned long long hyperagent_nccl_selected_chunk(void) { return atomic_load(&chunk_bytes); }

EXPORT unsigned long long hyperagent_nccl_fallbacks(void) { return atomic_load(&fallbacks); }

/* Bit a set: some AllReduce cost table offered algorithm a (an entry >= 0). */
EXPORT unsigned int hyperagent_nccl_offered(void) { return atomic_load(&offered); }

/* The newest interface version NCCL initialised in this process (0: none yet). */
EXPORT int hyperagent_nccl_loaded_version(void) { return atomic_load(&loaded_version); }

static void note_version(int version) {
  int seen = atomic_load(&loaded_version);
  while (seen < version && !atomic_compare_exchange_weak(&loaded_version, &seen, version)) {
  }
}

static ncclResult_t init_context(int version, size_t ranks, size_t nodes, ncclDebugLogger_t log,
                                 void** context) {
  note_version(version);
  shared_contexts[0].log = log;
  shared_contexts[0].ranks = ranks;
  shared_contexts[0].nodes = nodes;
  *context = &shared_contexts[0];
  if (log) log(NCCL_LOG_INFO, NCCL_INIT | NCCL_TUNING, __FILE__, __LINE__,
               "hyperagent tuner (v%d): %zu ranks, %zu nodes", version, ranks, nodes);
  return ncclSuccess;
}

static ncclResult_t finalize(void* context) {
  (void)context;
  return ncclSuccess;
}

static int usable(float cost) { return cost >= 0.0f && cost != (float)NCCL_ALGO_PROTO_IGNORE; }

static int cheapest(const float* table, int numAlgo, int numProto, int algorithm, int protocol,
                    int* chosen_algorithm, int* chosen_protocol) {
  int found = 0;
  float best = 0.0f;
  for (int a = 0; a < numAlgo; a++) {
    if (algorithm != NO_CHOICE && a != algorithm) continue;
    for (int p = 0; p < numProto; p++) {
      if (protocol != NO_CHOICE && p != protocol) continue;
      float cost = table[a * numProto + p];
      if (usable(cost) && (!found || cost < best)) {
        found = 1;
        best = cost;
        *chosen_algorithm = a;
        *chosen_protocol = p;
      }
    }
  }
  return found;
}

static ncclResult_t get_coll_info(void* context, ncclFunc_t collType, size_t nBytes,
                                  int numPipeOps, float** collCostTable, int numAlgo,
                                  int numProto, int regBuff, int* nChannels) {
  (void)nBytes;
  (void)numPipeOps;
  (void)regBuff;
  if (collType != ncclFuncAllReduce || collCostTable == NULL || numAlgo <= 0 || numProto <= 0)
    return ncclSuccess;
  float* table = (float*)collCostTable;
  unsigned int seen = 0;
  for (int a = 0; a < numAlgo && a < 32; a++)
    for (int p = 0; p < numProto; p++)
      if (usable(table[a * numProto + p])) seen |= 1u << a;
  atomic_fetch_or(&offered, seen);

  int algorithm, protocol, channels;
  uint64_t now_generation = atomic_load(&generation);
  hyperagent_nccl_selected(&algorithm, &protocol, &channels);
  if (algorithm == NO_CHOICE && protocol == NO_CHOICE) return ncclSuccess;
  int a = NO_CHOICE, p = NO_CHOICE;
  int inside = algorithm < numAlgo && protocol < numProto;
  if (!inside || !cheapest(table, numAlgo, numProto, algorithm, protocol, &a, &p)) {
    atomic_fetch_add(&fallbacks, 1);
    return ncclSuccess;
  }
  table[a * numProto + p] = 0.0f;
  if (channels > 0 && nChannels != NULL) *nChannels = channels;
  struct context* ctx = context;
  if (ctx && ctx->log && atomic_exchange(&logged_generation, now_generation) != now_generation)
    ctx->log(NCCL_LOG_INFO, NCCL_TUNING, __FILE__, __LINE__,
             "hyperagent tuner: AllReduce algorithm %d protocol %d channels %d (%s)", a, p,
             channels, channels > 0 ? "set" : "NCCL's");
  return ncclSuccess;
}

static ncclResult_t get_coll_info_v3(void* context, ncclFunc_t collType, size_t nBytes,
                                     int numPipeOps, float** collCostTable, int numAlgo,
                                     int numProto, int* nChannels) {
  return get_coll_info(context, collType, nBytes, numPipeOps, collCostTable, numAlgo, numProto,
                       0, nChannels);
}

static ncclResult_t get_chunk_size(void* context, ncclFunc_t collType, size_t nBytes, int algo,
                                   int proto, int nChannels, size_t* chunkSize) {
  (void)context;
  (void)nBytes;
  (void)algo;
  (void)proto;
  (void)nChannels;
  unsigned long long bytes = atomic_load(&chunk_bytes);
  if (collType == ncclFuncAllReduce && bytes > 0 && chunkSize != NULL) *chunkSize = (size_t)bytes;
  return ncclSuccess;
}

static ncclResult_t init_v3(size_t nRanks, size_t nNodes, ncclDebugLogger_t log, void** ctx) {
  return init_context(3, nRanks, nNodes, log, ctx);
}

static ncclResult_t init_v4(size_t nRanks, size_t nNodes, ncclDebugLogger_t log, void** ctx) {
  return init_context(4, nRanks, nNodes, log, ctx);
}

static ncclResult_t init_v5(void** ctx, uint64_t commId, size_t nRanks, size_t nNodes,
                            ncclDebugLogger_t log, ncclNvlDomainInfo_v5_t* nvl,
                            ncclTunerConstants_v5_t* constants) {
  (void)commId;
  (void)nvl;
  (void)constants;
  return init_context(5, nRanks, nNodes, log, ctx);
}

static ncclResult_t init_v6(void** ctx, uint64_t commId, size_t nRanks, size_t nNodes,
                            ncclDebugLogger_t log, ncclNvlDomainInfo_v6_t* nvl,
                            ncclTunerConstants_v6_t* constants) {
  (void)commId;
  (void)nvl;
  (void)constants;
  return init_context(6, nRanks, nNodes, log, ctx);
}

#define NAME "hyperagent"

EXPORT const ncclTuner_v6_t ncclTunerPlugin_v6 = {NAME, init_v6, get_coll_info, finalize,
                                                  get_chunk_size};
EXPORT const ncclTuner_v5_t ncclTunerPlugin_v5 = {NAME, init_v5, get_coll_info, finalize};
EXPORT const ncclTuner_v4_t ncclTunerPlugin_v4 = {NAME, init_v4, get_coll_info, finalize};
EXPORT const ncclTuner_v3_t ncclTunerPlugin_v3 = {NAME, init_v3, get_coll_info_v3, finalize};
