// Every instance of the kernels, for builds that compile ahead of time (the
// nvcc build of CMakeLists.txt and its static checks). At run time CuPy
// compiles only the instances a call needs (collectives/kernels.py).

#include "batched_copy.cu"  // not a template: its one instance comes with the definition
#include "plan_step.cu"

#define COLLECTIVES_STEP_INSTANCE(Element, Op)                                              \
    template __global__ void collectives::plan_step<collectives::Element, collectives::Op>( \
        const long long*, int, collectives::BufferTable, int, int);

#define COLLECTIVES_STEP_INSTANCES(Element)         \
    COLLECTIVES_STEP_INSTANCE(Element, kSum)        \
    COLLECTIVES_STEP_INSTANCE(Element, kProd)       \
    COLLECTIVES_STEP_INSTANCE(Element, kMax)        \
    COLLECTIVES_STEP_INSTANCE(Element, kMin)

COLLECTIVES_FOR_EACH_ELEMENT(COLLECTIVES_STEP_INSTANCES)

#include "codec.cu"

#define COLLECTIVES_CODEC_INSTANCE(Codec, Op) \
    template __global__ void collectives::codec_kernel<Codec, Op>(collectives::CodecArgs);

COLLECTIVES_FOR_EACH_CODEC_KERNEL(COLLECTIVES_CODEC_INSTANCE)

#define COLLECTIVES_CODEC_BATCH_INSTANCE(Codec) \
    template __global__ void collectives::codec_batch<Codec>(const __grid_constant__ collectives::CodecBatch);

COLLECTIVES_FOR_EACH_CODEC(COLLECTIVES_CODEC_BATCH_INSTANCE)

#define COLLECTIVES_CODEC_SUM_INSTANCE(Codec) \
    template __global__ void collectives::codec_round_sum<Codec>(const __grid_constant__ collectives::CodecSumArgs);

COLLECTIVES_FOR_EACH_CODEC(COLLECTIVES_CODEC_SUM_INSTANCE)

#include "ll_allreduce.cu"

#define COLLECTIVES_LL_INSTANCE(Element, Op)                                                   \
    template __global__ void collectives::ll_allreduce<collectives::Element, collectives::Op>( \
        const collectives::LLAllreduceArgs);

#define COLLECTIVES_LL_INSTANCES(Element)       \
    COLLECTIVES_LL_INSTANCE(Element, kSum)      \
    COLLECTIVES_LL_INSTANCE(Element, kProd)     \
    COLLECTIVES_LL_INSTANCE(Element, kMax)      \
    COLLECTIVES_LL_INSTANCE(Element, kMin)

COLLECTIVES_FOR_EACH_ELEMENT(COLLECTIVES_LL_INSTANCES)
