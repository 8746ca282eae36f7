#include "gpu/uuid.h"

#include <gtest/gtest.h>

#include <string>

namespace gpusnap::gpu {
namespace {

TEST(GpuUuidTest, ParsesBytesInPrintedOrder) {
  const auto bytes = parse_gpu_uuid("GPU-00112233-4455-6677-8899-aabbccddeeff");
  ASSERT_TRUE(bytes.has_value());
  for (size_t i = 0; i < bytes->size(); ++i) {
    EXPECT_EQ((*bytes)[i], static_cast<unsigned char>(i * 0x11)) << "byte " << i;
  }
}

TEST(GpuUuidTest, RoundTripsNvmlText) {
  // The shape nvidia-smi -L prints.
  const std::string text = "GPU-3b1f4c6e-9a2d-5e7b-c08f-1d2e3f405162";
  const auto bytes = parse_gpu_uuid(text);
  ASSERT_TRUE(bytes.has_value());
  EXPECT_EQ(format_gpu_uuid(*bytes), text);
}

TEST(GpuUuidTest, AcceptsUpperCaseHexAndFormatsLowerCase) {
  const auto bytes = parse_gpu_uuid("GPU-ABCDEF01-2345-6789-ABCD-EF0123456789");
  ASSERT_TRUE(bytes.has_value());
  EXPECT_EQ(format_gpu_uuid(*bytes), "GPU-abcdef01-2345-6789-abcd-ef0123456789");
}

TEST(GpuUuidTest, FormatsExtremes) {
  GpuUuidBytes zeros{};
  EXPECT_EQ(format_gpu_uuid(zeros), "GPU-00000000-0000-0000-0000-000000000000");
  GpuUuidBytes ones;
  ones.fill(0xff);
  EXPECT_EQ(format_gpu_uuid(ones), "GPU-ffffffff-ffff-ffff-ffff-ffffffffffff");
  EXPECT_EQ(parse_gpu_uuid(format_gpu_uuid(ones)), ones);
}

TEST(GpuUuidTest, RejectsMalformedText) {
  const char* bad[] = {
      "",
      "GPU-",
      "3b1f4c6e-9a2d-5e7b-c08f-1d2e3f405162",       // no prefix
      "gpu-3b1f4c6e-9a2d-5e7b-c08f-1d2e3f405162",   // NVML writes the prefix in upper case
      "MIG-3b1f4c6e-9a2d-5e7b-c08f-1d2e3f405162",   // a MIG instance, not a GPU
      "GPU-3b1f4c6e9a2d5e7bc08f1d2e3f405162",       // no dashes
      "GPU-3b1f4c6-e9a2d-5e7b-c08f-1d2e3f405162",   // wrong grouping
      "GPU-3b1f4c6e-9a2d-5e7b-c08f-1d2e3f40516",    // one digit short
      "GPU-3b1f4c6e-9a2d-5e7b-c08f-1d2e3f4051623",  // one digit long
      "GPU-3b1f4c6e-9a2d-5e7b-c08f-1d2e3f405162-",  // trailing dash
      "GPU-3b1f4c6e-9a2d-5e7b-c08f-1d2e3f40516g",   // not hex
      "GPU-3b1f4c6e-9a2d-5e7b-c08f-1d2e3f405162 ",  // trailing space
      " GPU-3b1f4c6e-9a2d-5e7b-c08f-1d2e3f405162",  // leading space
      "GPU-3b1f4c6e-9a2d-5e7b-c08f_1d2e3f405162",   // wrong separator
  };
  for (const char* text : bad) {
    EXPECT_FALSE(parse_gpu_uuid(text).has_value()) << "'" << text << "'";
  }
}

TEST(GpuUuidTest, RejectsEmbeddedNul) {
  const std::string text("GPU-3b1f4c6e-9a2d-5e7b-c08f-1d2e3f405162\0", 41);
  EXPECT_FALSE(parse_gpu_uuid(text).has_value());
}

}  // namespace
}  // namespace gpusnap::gpu
