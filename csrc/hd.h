// VRS_HD marks functions shared by the CPU and CUDA builds of a kernel.
#pragma once

#ifndef VRS_HD
#if defined(__CUDACC__)
#define VRS_HD __host__ __device__
#else
#define VRS_HD
#endif
#endif
