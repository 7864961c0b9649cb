// Entry point of the GPU tests. Without a CUDA device every test reports Skipped in ctest (exit
// code 77, the tests' SKIP_RETURN_CODE) instead of passing or failing. Listing tests (which
// catch_discover_tests does at build time) works without a device.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <cuda_runtime_api.h>

#include <cstdio>

#include "gpu_support.hpp"

namespace halfstep_test {
bool g_skipped = false;
std::string g_digest_dir;
void skip_test(const std::string& why) {
  std::printf("SKIPPED: %s\n", why.c_str());
  g_skipped = true;
}
}  // namespace halfstep_test

int main(int argc, char** argv) {
  Catch::Session session;
  using Catch::clara::Opt;
  session.cli(session.cli() |
              Opt(halfstep_test::g_digest_dir, "dir")["--digest-dir"](
                  "write a digest of every buffer each case-matrix case wrote into dir"));
  const int rc = session.applyCommandLine(argc, argv);
  if (rc != 0) return rc;
  const Catch::ConfigData& c = session.configData();
  const bool listing = c.listTests || c.listTestNamesOnly || c.listTags || c.listReporters;
  if (!listing) {
    int devices = 0;
    const cudaError_t status = cudaGetDeviceCount(&devices);
    if (status != cudaSuccess || devices == 0) {
      std::printf("SKIPPED: no CUDA device (%s)\n",
                  status == cudaSuccess ? "none found" : cudaGetErrorString(status));
      return halfstep_test::kSkipReturnCode;
    }
  }
  const int failed = session.run();
  if (failed == 0 && halfstep_test::g_skipped) return halfstep_test::kSkipReturnCode;
  return failed;
}
