/* A stand-in libcuda.so.1 for hosts without an NVIDIA driver, so that NIXL's LIBFABRIC plugin loads
 * (it links libcuda for VRAM, which such hosts never register).  It imports exactly these four entry
 * points; each reports "no device", and no pointer is a device pointer.  Built by
 * kvpush_common.testing.libfabric.build_libcuda_standin, never installed system-wide. */
#include <stddef.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;

enum { CUDA_ERROR_NO_DEVICE = 100 };

CUresult cuCtxSetCurrent(CUcontext ctx) { (void)ctx; return CUDA_ERROR_NO_DEVICE; }

CUresult cuDeviceGetPCIBusId(char *bus_id, int len, CUdevice dev) {
    (void)dev;
    if (bus_id && len > 0) bus_id[0] = '\0';
    return CUDA_ERROR_NO_DEVICE;
}

/* Every attribute reads as zero: memory type 0 is "not CUDA memory" (host is 1, device 2). */
CUresult cuPointerGetAttributes(unsigned int n, int *attributes, void **data, CUdeviceptr ptr) {
    (void)attributes; (void)ptr;
    for (unsigned int i = 0; data && i < n; i++)
        if (data[i]) *(unsigned int *)data[i] = 0;
    return 0;
}

CUresult cuGetErrorString(CUresult error, const char **str) {
    (void)error;
    if (str) *str = "no CUDA device (kvpush stand-in libcuda)";
    return 0;
}
