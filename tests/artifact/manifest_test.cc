// Manifest serialization and Artifact::open's format checks: what a user sees when an artifact
// is foreign, damaged, incomplete or forged.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <utility>
#include <vector>
#include <nlohmann/json.hpp>

#include "gpusnap/artifact.h"
#include "gpusnap/error.h"
#include "testing/unit.h"

namespace gpusnap {
namespace {

using namespace gpusnap::testing;  // testing/unit.h

namespace stdfs = std::filesystem;
using nlohmann::json;

Manifest full_manifest() {
  Manifest m;
  m.id = "0123456789abcdef0123456789abcdef";
  m.created = "2024-05-01T12:34:56Z";
  m.gpusnap_version = "0.1.0";
  m.source_pid = 4242;
  m.source_cmdline = {"/usr/bin/python3", "serve.py", "--port", "8080"};
  m.host.hostname = "gpu-node-7";
  m.host.kernel = "6.8.0-45-generic";
  m.host.arch = "x86_64";
  m.host.cpu_model = "AMD EPYC 9654 96-Core Processor";
  m.host.cpu_flags = {"avx", "avx2", "avx512f", "fpu", "sse4_2"};
  m.host.criu_version = "4.2";
  m.host.page_size = 4096;
  m.shell_job = true;
  ProcessRecord root;
  root.pid = 4242;
  root.ppid = 1;
  root.comm = "python3";
  root.cmdline = m.source_cmdline;
  root.threads = 12;
  root.rss_bytes = 3ull << 30;
  root.gpu_bytes = 40ull << 30;  // above 2^32: must survive as a 64-bit number
  root.stdio = {{0, "/dev/null"}, {1, "/tmp/serve.log"}, {2, "pipe:[31337]"}};
  ProcessRecord child;
  child.pid = 4250;
  child.ppid = 4242;
  child.comm = "worker";
  child.cmdline = {"worker"};
  child.threads = 1;
  child.rss_bytes = 1 << 20;
  m.processes = {root, child};
  GpuFacts gpu;
  gpu.driver_version = "550.54.15";
  gpu.cuda_driver_version = 12040;
  gpu.gpus = {{0, true, "GPU-0000", "NVIDIA H200", "0000:19:00.0", "9.0", 143771ull << 20},
              {1, false, "GPU-0001", "NVIDIA H200", "0000:3b:00.0", "9.0", 143771ull << 20}};
  gpu.processes = {{4242, 40ull << 30, {{"GPU-0000", 40ull << 30}}}};
  m.gpu = gpu;
  m.chunk_bytes = 1 << 20;
  m.files = {{"criu/pages-1.img", 3 << 20, {"aa", "bb", "cc"}},
             {"criu/empty.img", 0, {"dd"}},
             // The host image's own file: its range (2 MiB) after its offset in the file.
             {"host-images/4242-7f00001db000.img", 0x3db000, {"e1", "e2", "e3", "e4"}}};
  m.host_images = {{4242, 0x7f00001db000, 0x7f00003db000, "host-images/4242-7f00001db000.img",
                    0x1db000, "file[2a:1f3]", 1 << 20}};
  m.checkpoint_phases = {{"freeze", 0.25}, {"dump", 1.5}};
  return m;
}

TEST(ManifestTest, RoundTripsEveryField) {
  const Manifest m = full_manifest();
  const Manifest back = Manifest::from_json(json::parse(m.to_json().dump()));

  EXPECT_EQ(back.to_json(), m.to_json());
  EXPECT_EQ(back.format, "gpusnap-artifact");
  EXPECT_EQ(back.format_version, 2);
  ASSERT_EQ(back.host_images.size(), 1u);
  EXPECT_EQ(back.host_images[0].start, 0x7f00001db000u);
  EXPECT_EQ(back.host_images[0].file_offset, 0x1db000u);
  EXPECT_EQ(back.host_images[0].criu_key, "file[2a:1f3]");
  EXPECT_EQ(back.id, m.id);
  EXPECT_EQ(back.created, m.created);
  EXPECT_EQ(back.gpusnap_version, "0.1.0");
  EXPECT_EQ(back.source_pid, 4242);
  EXPECT_EQ(back.source_cmdline, m.source_cmdline);
  EXPECT_EQ(back.host.hostname, "gpu-node-7");
  EXPECT_EQ(back.host.kernel, "6.8.0-45-generic");
  EXPECT_EQ(back.host.arch, "x86_64");
  EXPECT_EQ(back.host.cpu_model, m.host.cpu_model);
  EXPECT_EQ(back.host.cpu_flags, m.host.cpu_flags);
  EXPECT_EQ(back.host.criu_version, "4.2");
  EXPECT_EQ(back.host.page_size, 4096);
  EXPECT_TRUE(back.shell_job);
  ASSERT_EQ(back.processes.size(), 2u);
  EXPECT_EQ(back.processes[0].pid, 4242);
  EXPECT_EQ(back.processes[0].ppid, 1);
  EXPECT_EQ(back.processes[0].comm, "python3");
  EXPECT_EQ(back.processes[0].cmdline, m.source_cmdline);
  EXPECT_EQ(back.processes[0].threads, 12);
  EXPECT_EQ(back.processes[0].rss_bytes, 3ull << 30);
  EXPECT_EQ(back.processes[0].gpu_bytes, 40ull << 30);
  ASSERT_EQ(back.processes[0].stdio.size(), 3u);
  EXPECT_EQ(back.processes[0].stdio[1].fd, 1);
  EXPECT_EQ(back.processes[0].stdio[1].target, "/tmp/serve.log");
  EXPECT_EQ(back.processes[0].stdio[2].target, "pipe:[31337]");
  EXPECT_EQ(back.processes[1].pid, 4250);
  EXPECT_EQ(back.processes[1].ppid, 4242);
  EXPECT_TRUE(back.processes[1].stdio.empty());
  ASSERT_TRUE(back.gpu);
  EXPECT_EQ(back.gpu->driver_version, "550.54.15");
  EXPECT_EQ(back.gpu->cuda_driver_version, 12040);
  ASSERT_EQ(back.gpu->gpus.size(), 2u);
  EXPECT_EQ(back.gpu->gpus[1].index, 1);
  EXPECT_FALSE(back.gpu->gpus[1].used);
  EXPECT_EQ(back.gpu->gpus[1].uuid, "GPU-0001");
  EXPECT_EQ(back.gpu->gpus[1].name, "NVIDIA H200");
  EXPECT_EQ(back.gpu->gpus[1].bus_id, "0000:3b:00.0");
  EXPECT_EQ(back.gpu->gpus[1].compute_capability, "9.0");
  EXPECT_EQ(back.gpu->gpus[1].memory_total, 143771ull << 20);
  ASSERT_EQ(back.gpu->processes.size(), 1u);
  EXPECT_EQ(back.gpu->processes[0].pid, 4242);
  EXPECT_EQ(back.gpu->processes[0].bytes, 40ull << 30);
  ASSERT_EQ(back.gpu->processes[0].gpus.size(), 1u);
  EXPECT_EQ(back.gpu->processes[0].gpus[0].uuid, "GPU-0000");
  EXPECT_EQ(back.gpu->processes[0].gpus[0].bytes, 40ull << 30);
  EXPECT_FALSE(back.container);
  EXPECT_EQ(back.checksum_algorithm, "xxh3-128");
  EXPECT_EQ(back.chunk_bytes, 1u << 20);
  ASSERT_EQ(back.files.size(), 3u);
  EXPECT_EQ(back.files[0].path, "criu/pages-1.img");
  EXPECT_EQ(back.files[0].size, 3u << 20);
  EXPECT_EQ(back.files[0].chunks, (std::vector<std::string>{"aa", "bb", "cc"}));
  EXPECT_EQ(back.files[1].size, 0u);
  ASSERT_EQ(back.checkpoint_phases.size(), 2u);
  EXPECT_EQ(back.checkpoint_phases[1].name, "dump");
  EXPECT_DOUBLE_EQ(back.checkpoint_phases[1].seconds, 1.5);
  EXPECT_EQ(back.total_bytes(), (3u << 20) + 0x3db000);
}

TEST(ManifestTest, NullGpuMeansNoGpuState) {
  Manifest m = full_manifest();
  m.gpu.reset();
  EXPECT_TRUE(m.to_json().at("gpu").is_null());
  EXPECT_FALSE(Manifest::from_json(m.to_json()).gpu);
}

TEST(ManifestTest, RoundTripsAContainerCapture) {
  Manifest m = full_manifest();
  m.container = ContainerRecord{"runc",
                                "web-1",
                                "/var/lib/c/web-1",
                                "/var/lib/c/web-1/rootfs",
                                {{"/bin/app", 12345, "8af223c2582302de", ""},
                                 {"/lib/libc.so.6", 2000, "", "571d98e01096d5c1c32420d2"}},
                                "/run/containerd/runc/k8s.io"};
  const Manifest back = Manifest::from_json(m.to_json());
  EXPECT_EQ(back.to_json(), m.to_json());
  ASSERT_TRUE(back.container);
  EXPECT_EQ(back.container->runtime, "runc");
  EXPECT_EQ(back.container->runtime_root, "/run/containerd/runc/k8s.io");
  EXPECT_EQ(back.container->id, "web-1");
  EXPECT_EQ(back.container->bundle, "/var/lib/c/web-1");
  EXPECT_EQ(back.container->rootfs, "/var/lib/c/web-1/rootfs");
  ASSERT_EQ(back.container->rootfs_files.size(), 2u);
  EXPECT_EQ(back.container->rootfs_files[0].path, "/bin/app");
  EXPECT_EQ(back.container->rootfs_files[0].size, 12345u);
  EXPECT_EQ(back.container->rootfs_files[0].xxh3, "8af223c2582302de");
  EXPECT_EQ(back.container->rootfs_files[0].build_id, "");
  EXPECT_EQ(back.container->rootfs_files[1].build_id, "571d98e01096d5c1c32420d2");
  EXPECT_EQ(back.container->rootfs_files[1].xxh3, "");
  EXPECT_FALSE(m.to_json()["container"]["rootfs_files"][1].contains("xxh3"))
      << "a file identified by its build-id has no empty checksum beside it";
  EXPECT_FALSE(m.to_json()["container"]["rootfs_files"][0].contains("build_id"));
  // A manifest written before build-ids identifies every file by its content.
  json doc = m.to_json();
  doc["container"]["rootfs_files"].erase(1);
  EXPECT_EQ(Manifest::from_json(doc).container->rootfs_files[0].xxh3, "8af223c2582302de");
}

// A container's files are opened inside the placeholder's root, but a forged list is refused
// before that: a relative path, a "..", an identity that is not one short hex string.
TEST(ManifestTest, RefusesForgedContainerFiles) {
  const std::string huge(200, 'a');
  const std::vector<std::pair<RootfsFileRecord, std::string>> cases = {
      {{"bin/app", 1, "ab", ""}, "manifest lists an unsafe container file 'bin/app'"},
      {{"/lib/../../etc/shadow", 1, "ab", ""},
       "manifest lists an unsafe container file '/lib/../../etc/shadow'"},
      {{"/bin/app", 1, "", ""},
       "manifest identifies the container file '/bin/app' by neither one checksum nor one "
       "build-id"},
      {{"/bin/app", 1, "ab", "cd"},
       "manifest identifies the container file '/bin/app' by neither one checksum nor one "
       "build-id"},
      {{"/bin/app", 1, "", "not hex"},
       "manifest identifies the container file '/bin/app' by neither one checksum nor one "
       "build-id"},
      {{"/bin/app", 1, huge, ""},
       "manifest identifies the container file '/bin/app' by neither one checksum nor one "
       "build-id"}};
  for (const auto& [file, message] : cases) {
    SCOPED_TRACE(file.path);
    Manifest m = full_manifest();
    m.container = ContainerRecord{"runc", "web-1", "/b", "/b/rootfs", {file}, ""};
    Error e = catch_error([&] { Manifest::from_json(m.to_json()); });
    EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
    EXPECT_EQ(e.what(), message);
  }
}

// The GPU and container sections are typed like the rest: a malformed one is a bad artifact
// that names its field, never a JSON library exception.
TEST(ManifestTest, MalformedGpuOrContainerSectionIsABadArtifactNamingTheField) {
  struct Case {
    const char* pointer;  // JSON pointer of the field to replace
    json value;
    const char* message;
  };
  const Case cases[] = {
      {"/gpu", "x",
       "manifest field 'gpu' has the wrong type: expected an object or null, found "
       "string"},
      {"/gpu/driver_version", 550,
       "manifest field 'driver_version' has the wrong type: expected "
       "a string, found number"},
      {"/gpu/gpus", json::object(),
       "manifest field 'gpus' has the wrong type: expected an array, found object"},
      {"/gpu/gpus/0/used", "yes",
       "manifest field 'used' has the wrong type: expected true or false, found string"},
      {"/gpu/gpus/1/memory_total", -1,
       "manifest field 'memory_total' has the wrong type: "
       "expected an unsigned integer, found number"},
      {"/gpu/processes/0/pid", "4242",
       "manifest field 'pid' has the wrong type: expected an integer, found string"},
      {"/gpu/processes/0/gpus/0/uuid", "GPU-9999",
       "manifest field 'gpu' names GPU GPU-9999 for process 4242 but does not list it"},
      {"/container", json::array(),
       "manifest field 'container' has the wrong type: expected an object or null, found array"},
      {"/container/id", 7,
       "manifest field 'id' has the wrong type: expected a string, found "
       "number"},
      {"/container/rootfs_files/0/size", "big",
       "manifest field 'size' has the wrong type: expected an integer, found string"},
      {"/container/rootfs_files/0", json::object({{"path", "/a"}, {"size", 1}}),
       "manifest identifies the container file '/a' by neither one checksum nor one build-id"},
      {"/container/rootfs_files/0/xxh3", 7,
       "manifest field 'xxh3' has the wrong type: expected a string, found number"}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.pointer);
    Manifest m = full_manifest();
    m.container =
        ContainerRecord{"runc", "web-1", "/b", "/b/rootfs", {{"/bin/app", 1, "ab", ""}}, ""};
    json doc = m.to_json();
    doc[json::json_pointer(c.pointer)] = c.value;
    Error e = catch_error([&] { Manifest::from_json(doc); });
    EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
    EXPECT_STREQ(e.what(), c.message);
    EXPECT_FALSE(e.hint().empty());
  }
}

TEST(ManifestTest, GpuAndContainerSectionsAreRequiredFields) {
  for (const char* field : {"gpu", "container"}) {
    SCOPED_TRACE(field);
    json doc = full_manifest().to_json();
    doc.erase(field);
    Error e = catch_error([&] { Manifest::from_json(doc); });
    EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
    EXPECT_EQ(std::string(e.what()), std::string("manifest lacks the field '") + field + "'");
  }
}

TEST(ManifestTest, RefusesForeignFormat) {
  json doc = full_manifest().to_json();
  doc["format"] = "oci-image";
  Error e = catch_error([&] { Manifest::from_json(doc); });
  EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
  EXPECT_STREQ(e.what(), "not a gpusnap artifact (format 'oci-image')");
  EXPECT_TRUE(Contains(e.hint(), "gpusnap checkpoint"));
}

TEST(ManifestTest, RefusesUnsupportedFormatVersionNamingBoth) {
  json doc = full_manifest().to_json();
  doc["format_version"] = 3;
  Error e = catch_error([&] { Manifest::from_json(doc); });
  EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
  EXPECT_STREQ(e.what(),
               "artifact format version 3 is not supported (this gpusnap reads version 2)");
  doc["format_version"] = 1;  // never written: 2 replaced it before any artifact of 1 existed
  EXPECT_STREQ(catch_error([&] { Manifest::from_json(doc); }).what(),
               "artifact format version 1 is not supported (this gpusnap reads version 2)");
}

TEST(ManifestTest, RefusesAnEmptyHostImageRange) {
  json doc = full_manifest().to_json();
  doc["host_images"][0]["end"] = doc["host_images"][0]["start"];
  Error e = catch_error([&] { Manifest::from_json(doc); });
  EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
  EXPECT_STREQ(e.what(), "manifest has an empty host image range");
}

TEST(ManifestTest, MissingFieldIsNamed) {
  struct Case {
    const char* pointer;  // JSON pointer of the object to remove the field from
    const char* field;
  };
  const Case cases[] = {{"", "format"},
                        {"", "id"},
                        {"", "files"},
                        {"", "checkpoint_phases"},
                        {"/host", "arch"},
                        {"/host", "page_size"},
                        {"/source", "pid"},
                        {"/criu", "shell_job"},
                        {"/checksum", "chunk_bytes"},
                        {"/processes/1", "comm"},
                        {"/processes/0/stdio/2", "target"},
                        {"/files/1", "chunks"},
                        {"/host_images/0", "file_offset"},
                        {"/gpu", "driver_version"},
                        {"/gpu/gpus/0", "used"},
                        {"/gpu/processes/0/gpus/0", "bytes"}};
  for (const auto& c : cases) {
    SCOPED_TRACE(std::string(c.pointer) + "/" + c.field);
    json doc = full_manifest().to_json();
    ASSERT_EQ(doc[json::json_pointer(c.pointer)].erase(c.field), 1u);
    Error e = catch_error([&] { Manifest::from_json(doc); });
    EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
    EXPECT_EQ(std::string(e.what()), std::string("manifest lacks the field '") + c.field + "'");
  }
}

TEST(ManifestTest, WrongTypeIsNamed) {
  struct Case {
    const char* pointer;  // JSON pointer of the field to replace
    json value;
    const char* field;
  };
  const Case cases[] = {{"/format", 1, "format"},
                        {"/format_version", "1", "format_version"},
                        {"/source/pid", "4242", "pid"},
                        {"/host/cpu_flags", "avx", "cpu_flags"},
                        {"/criu/shell_job", "yes", "shell_job"},
                        {"/processes/0/threads", "many", "threads"},
                        {"/files/0/size", json::array(), "size"},
                        {"/checkpoint_phases/0/seconds", "fast", "seconds"}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.pointer);
    json doc = full_manifest().to_json();
    doc[json::json_pointer(c.pointer)] = c.value;
    Error e = catch_error([&] { Manifest::from_json(doc); });
    EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
    EXPECT_TRUE(
        Contains(e.what(), std::string("manifest field '") + c.field + "' has the wrong type: "));
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << "message is one line";
  }
}

TEST(ManifestTest, NonObjectWhereAnObjectBelongsIsTheWrongTypeOfThatField) {
  struct Case {
    const char* pointer;  // JSON pointer of the field to replace
    json value;
    const char* message;
  };
  const Case cases[] = {{"/host", "x86_64",
                         "manifest field 'host' has the wrong type: "
                         "expected an object, found string"},
                        {"/source", 4242,
                         "manifest field 'source' has the wrong type: "
                         "expected an object, found number"},
                        {"/criu", json::array(),
                         "manifest field 'criu' has the wrong type: "
                         "expected an object, found array"},
                        {"/checksum", nullptr,
                         "manifest field 'checksum' has the wrong type: "
                         "expected an object, found null"},
                        {"/processes", "python3",
                         "manifest field 'processes' has the wrong type: "
                         "expected an array, found string"},
                        {"/processes/1", "worker",
                         "manifest field 'processes' has the wrong type: "
                         "expected an array of objects, found string"},
                        {"/processes/0/stdio", json::object(),
                         "manifest field 'stdio' has the wrong type: "
                         "expected an array, found object"},
                        {"/processes/0/stdio/1", 1,
                         "manifest field 'stdio' has the wrong type: "
                         "expected an array of objects, found number"},
                        {"/files", json::object({{"path", "x"}}),
                         "manifest field 'files' has the wrong type: "
                         "expected an array, found object"},
                        {"/files/0", "criu/pages-1.img",
                         "manifest field 'files' has the wrong type: "
                         "expected an array of objects, found string"},
                        {"/checkpoint_phases/1", 1.5,
                         "manifest field 'checkpoint_phases' has the wrong type: "
                         "expected an array of objects, found number"}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.pointer);
    json doc = full_manifest().to_json();
    doc[json::json_pointer(c.pointer)] = c.value;
    Error e = catch_error([&] { Manifest::from_json(doc); });
    EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
    EXPECT_STREQ(e.what(), c.message);
    EXPECT_FALSE(e.hint().empty());
  }
}

TEST(ManifestTest, NegativeOrFractionalNumbersAreTheWrongType) {
  struct Case {
    const char* pointer;
    json value;
    const char* field;
  };
  const Case cases[] = {{"/files/0/size", -1, "size"},
                        {"/files/1/size", 1.5, "size"},
                        {"/checksum/chunk_bytes", -4096, "chunk_bytes"},
                        {"/checksum/chunk_bytes", 4096.5, "chunk_bytes"},
                        {"/processes/0/rss_bytes", -1, "rss_bytes"},
                        {"/processes/1/gpu_bytes", -5, "gpu_bytes"},
                        {"/format_version", 1.9, "format_version"},
                        {"/format_version", 1.0, "format_version"},
                        {"/host/page_size", 4096.5, "page_size"},
                        {"/processes/0/threads", 2.5, "threads"}};
  for (const auto& c : cases) {
    SCOPED_TRACE(std::string(c.pointer) + " = " + c.value.dump());
    json doc = full_manifest().to_json();
    doc[json::json_pointer(c.pointer)] = c.value;
    Error e = catch_error([&] { Manifest::from_json(doc); });
    EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
    EXPECT_TRUE(
        Contains(e.what(), std::string("manifest field '") + c.field + "' has the wrong type: "));
  }
}

TEST(ManifestTest, NonNegativeSignedNumbersAreAccepted) {
  // A JSON integer built from a signed value is not "unsigned" to nlohmann: still a size.
  json doc = full_manifest().to_json();
  doc["files"][1]["size"] = static_cast<int64_t>(7);
  doc["checksum"]["chunk_bytes"] = static_cast<int>(1 << 20);
  doc["processes"][0]["rss_bytes"] = static_cast<int64_t>(0);
  Manifest m = Manifest::from_json(doc);
  EXPECT_EQ(m.files[1].size, 7u);
  EXPECT_EQ(m.chunk_bytes, 1u << 20);
  EXPECT_EQ(m.processes[0].rss_bytes, 0u);
}

TEST(ManifestTest, RefusesUnknownChecksumAlgorithm) {
  json doc = full_manifest().to_json();
  doc["checksum"]["algorithm"] = "md5";
  Error e = catch_error([&] { Manifest::from_json(doc); });
  EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
  EXPECT_STREQ(e.what(), "unknown checksum algorithm 'md5' in the manifest");
}

TEST(ManifestTest, RefusesZeroChunkSize) {
  json doc = full_manifest().to_json();
  doc["checksum"]["chunk_bytes"] = 0;
  Error e = catch_error([&] { Manifest::from_json(doc); });
  EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
  EXPECT_STREQ(e.what(), "manifest has a checksum chunk size of 0");
}

TEST(ManifestTest, RefusesNonObjectDocument) {
  Error e = catch_error([&] { Manifest::from_json(json::array({1, 2})); });
  EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
  EXPECT_STREQ(e.what(), "manifest lacks the field 'format'");
}

// A small but real artifact: two files and a manifest listing them with their checksums.
class ArtifactOpenTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root = dir.path() / "snap";
    write(root / "criu/pages-1.img", std::string(5000, 'p'));
    write(root / "criu/core-42.img", "core");
    manifest.id = "test";
    manifest.chunk_bytes = 4096;
    manifest.files = checksum_tree(root, manifest.chunk_bytes, VerifyOptions{1, nullptr});
    write_manifest();
  }

  void write_manifest() { write(root / kManifestName, manifest.to_json().dump(2)); }

  Error open_error() {
    return catch_error([&] { Artifact::open(root); });
  }

  TempDir dir;
  stdfs::path root;
  Manifest manifest;
};

TEST_F(ArtifactOpenTest, OpensIntactArtifact) {
  Artifact a = Artifact::open(root);
  EXPECT_EQ(a.root(), root);
  EXPECT_EQ(a.criu_dir(), root / "criu");
  EXPECT_EQ(a.manifest().to_json(), manifest.to_json());
  ASSERT_EQ(a.manifest().files.size(), 2u);
  EXPECT_EQ(a.manifest().files[0].path, "criu/core-42.img");
  EXPECT_EQ(a.manifest().files[1].path, "criu/pages-1.img");
  EXPECT_EQ(a.manifest().total_bytes(), 5004u);
}

TEST_F(ArtifactOpenTest, MissingDirectoryIsNotFound) {
  Error e = catch_error([&] { Artifact::open(dir.path() / "nope"); });
  EXPECT_EQ(e.kind(), ErrorKind::kNotFound);
  EXPECT_EQ(std::string(e.what()),
            "artifact " + (dir.path() / "nope").string() + " does not exist");
}

TEST_F(ArtifactOpenTest, RefusesPlainFile) {
  auto file = dir.path() / "snap.tar";
  write(file, "not a directory");
  Error e = catch_error([&] { Artifact::open(file); });
  EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
  EXPECT_EQ(std::string(e.what()), file.string() + " is not an artifact directory");
}

TEST_F(ArtifactOpenTest, RefusesDirectoryWithoutManifest) {
  stdfs::remove(root / kManifestName);
  Error e = open_error();
  EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
  EXPECT_EQ(std::string(e.what()), root.string() + " has no manifest.json");
}

TEST_F(ArtifactOpenTest, RefusesInvalidJson) {
  write(root / kManifestName, "{\"format\": \"gpusnap-artifact\", ");
  Error e = open_error();
  EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
  EXPECT_EQ(std::string(e.what()), "manifest.json in " + root.string() + " is not valid JSON");
}

TEST_F(ArtifactOpenTest, ManifestErrorsPassThrough) {
  manifest.format_version = 7;
  write_manifest();
  Error e = open_error();
  EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
  EXPECT_TRUE(Contains(e.what(), "artifact format version 7 is not supported"));
}

TEST_F(ArtifactOpenTest, RefusesMissingListedFile) {
  stdfs::remove(root / "criu/core-42.img");
  Error e = open_error();
  EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
  EXPECT_STREQ(e.what(), "artifact file criu/core-42.img is missing");
}

TEST_F(ArtifactOpenTest, RefusesTruncatedFile) {
  stdfs::resize_file(root / "criu/pages-1.img", 4096);
  Error e = open_error();
  EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
  EXPECT_STREQ(
      e.what(),
      "artifact file criu/pages-1.img has 4096 bytes, the manifest says 5000 (truncated?)");
}

TEST_F(ArtifactOpenTest, RefusesUnsafePaths) {
  // Each of these exists (or would) with the listed size: only the path itself is wrong.
  write(dir.path() / "outside", "core");
  for (const std::string path :
       {"../outside", "/etc/passwd", "criu/../../outside", "", "..", "criu/..", "./../outside"}) {
    SCOPED_TRACE(path);
    manifest.files = {{path, path == "/etc/passwd" ? stdfs::file_size("/etc/passwd") : 4, {"x"}}};
    write_manifest();
    Error e = open_error();
    EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
    EXPECT_EQ(std::string(e.what()), "manifest lists an unsafe path '" + path + "'");
  }
}

TEST_F(ArtifactOpenTest, AcceptsNamesThatOnlyContainDots) {
  // Only a ".." component leaves the artifact: these are ordinary names.
  for (const std::string name : {"criu/a..b", "criu/..hidden", "criu/x...img", "criu/dots.."}) {
    write(root / name, "abc");
  }
  stdfs::remove(root / kManifestName);  // a manifest does not list itself
  manifest.files = checksum_tree(root, manifest.chunk_bytes, VerifyOptions{1, nullptr});
  write_manifest();
  Artifact a = Artifact::open(root);
  EXPECT_EQ(a.manifest().files.size(), 6u);
  EXPECT_TRUE(a.verify().empty());
}

}  // namespace
}  // namespace gpusnap
