// The tier's folder format (src/tier/folder_format.h): the names, the index's writer and its
// bounded reader, and the text every drain so far wrote, which artifacts already hold.
#include "tier/folder_format.h"

#include <sys/stat.h>

#include <string>

#include <gtest/gtest.h>

#include "common/fs.h"
#include "gpusnap/error.h"
#include "testing/unit.h"

namespace gpusnap::tier::folder {
namespace {

using namespace gpusnap::testing;  // testing/unit.h

// As the drains before this format's owner wrote it (and as artifacts hold it).
constexpr const char* kWritten =
    "{\"format\":\"gpusnap-tier\",\"version\":1,\"pid\":4242,\"bytes\":12,"
    "\"files\":[{\"path\":\"4242-w0.img\",\"size\":8},{\"path\":\"4242-w1.img\",\"size\":4}],"
    "\"gpus\":[{\"uuid\":\"GPU-a\",\"bytes\":8},{\"uuid\":\"GPU-b\",\"bytes\":4}]}\n";

TierIndex two_gpus() {
  return {4242, 12, {{"4242-w0.img", 8}, {"4242-w1.img", 4}}, {{"GPU-a", 8}, {"GPU-b", 4}}};
}

TEST(FolderFormat, NamesAreClassifiedBackToTheirPid) {
  EXPECT_EQ(drain_file_name(4242, 3), "4242-w3.img");
  EXPECT_EQ(index_name(4242), "4242.json");
  EXPECT_EQ(layout_name("4242"), "4242.layout");
  EXPECT_EQ(classify("4242-w3.img").kind, EntryKind::kDrainFile);
  EXPECT_EQ(classify("4242-w3.img").pid, "4242");
  EXPECT_EQ(classify("7.json").kind, EntryKind::kIndex);
  EXPECT_EQ(classify("7.layout").kind, EntryKind::kLayout);
  EXPECT_EQ(classify("1234567890-w9999.img").kind, EntryKind::kDrainFile);
  for (const char* other :
       {"12345678901.json", "7-w12345.img", "7.json.tmp", "-w0.img", "7-w.img", "x7.json",
        "7-x0.img", "../7.json", "7/8.json", ".json", "", "7-w0.img~", "7-w0-w1.img"}) {
    EXPECT_EQ(classify(other).kind, EntryKind::kOther) << other;
  }
}

TEST(FolderFormat, PathsInAnArtifactAreClassifiedInsideItsTierFolderOnly) {
  EXPECT_EQ(classify_in_artifact("tier/4242-w3.img").kind, EntryKind::kDrainFile);
  EXPECT_EQ(classify_in_artifact("tier/4242-w3.img").pid, "4242");
  EXPECT_EQ(classify_in_artifact("tier/7.layout").kind, EntryKind::kLayout);
  for (const char* other : {"4242-w3.img", "host-images/7-w0.img", "tiers/7-w0.img", "tier7-w0.img",
                            "tier/", "tier/x.img", "tier/sub/7-w0.img", "criu/tier/7-w0.img"}) {
    EXPECT_EQ(classify_in_artifact(other).kind, EntryKind::kOther) << other;
  }
}

TEST(FolderFormat, TheWriterWritesWhatDrainsAlwaysWroteAndTheReaderReadsItBack) {
  EXPECT_EQ(index_text(two_gpus()), kWritten);
  const auto back = parse_index(kWritten);
  ASSERT_TRUE(back);
  EXPECT_EQ(back->pid, 4242u);
  EXPECT_EQ(back->bytes, 12u);
  ASSERT_EQ(back->files.size(), 2u);
  EXPECT_EQ(back->files[1].path, "4242-w1.img");
  EXPECT_EQ(back->files[1].size, 4u);
  ASSERT_EQ(back->gpus.size(), 2u);
  EXPECT_EQ(back->gpus[0].uuid, "GPU-a");
  EXPECT_EQ(back->gpus[0].bytes, 8u);
  // Whitespace and member order are JSON's own business.
  EXPECT_TRUE(parse_index(R"({"gpus": [], "files": [], "bytes": 0, "pid": 9,
                              "version": 1, "format": "gpusnap-tier"})"));
}

TEST(FolderFormat, WriteIndexRenamesIntoPlaceAndRefusesAFileThere) {
  TempDir dir;
  write_index(dir.path(), two_gpus());
  std::string text;
  ASSERT_TRUE(fs::try_read_file(dir / "4242.json", &text));
  EXPECT_EQ(text, kWritten);
  struct stat st {};
  ASSERT_EQ(::stat((dir / "4242.json").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  write(dir / "4242.json.tmp", "somebody else's");
  const Error e = catch_error([&] { write_index(dir.path(), two_gpus()); });
  EXPECT_EQ(std::string(e.what()),
            "memory tier: cannot create " + (dir / "4242.json.tmp").string() + ": File exists");
}

TEST(FolderFormat, TheReaderRefusesWhatNoDrainWritesAndSaysWhy) {
  const auto why = [](const std::string& text) {
    std::string reason;
    EXPECT_FALSE(parse_index(text, &reason)) << text;
    return reason;
  };
  const std::string head = R"({"format":"gpusnap-tier","version":1,"pid":7,"bytes":0,)";
  EXPECT_EQ(why(R"({"format":"other","version":1})"),
            "an index of another format than gpusnap-tier version 1");
  EXPECT_EQ(why(R"({"format":"gpusnap-tier","version":2})"),
            "an index of another format than gpusnap-tier version 1");
  EXPECT_EQ(why("[1]"), "an index of another format than gpusnap-tier version 1");
  EXPECT_EQ(why(head + R"("files":[[[]]],"gpus":[]})"), "nested deeper than an index");
  EXPECT_EQ(why(head + R"("files":[{"path":"8-w0.img","size":1}],"gpus":[]})"),
            "files: \"8-w0.img\" is not a drain file of process 7");
  EXPECT_EQ(why(head + R"("files":[{"path":"../7-w0.img","size":1}],"gpus":[]})"),
            "files: \"../7-w0.img\" is not a drain file of process 7");
  EXPECT_EQ(why(head + R"("files":[{"path":"7-w0.img","size":1},{"path":"7-w0.img","size":1}],)"
                       R"("gpus":[]})"),
            "files: 7-w0.img twice");
  EXPECT_EQ(why(head + R"("files":[],"gpus":[{"uuid":"","bytes":1}]})"),
            "gpus: a UUID of 1 to 256 characters expected");
  EXPECT_EQ(why(head + R"("files":[],"gpus":[{"uuid":"G","bytes":1},{"uuid":"G","bytes":1}]})"),
            "gpus: G twice");
  EXPECT_EQ(why(head + R"("files":[],"gpus":[{"uuid":"G","bytes":-1}]})"),
            "bytes: -1 is not a whole number of at least 0");
  EXPECT_EQ(why(head + R"("files":[{"path":"7-w0.img","size":1.5}],"gpus":[]})"),
            "size: 1.5 is not a whole number of at least 0");
  EXPECT_TRUE(Contains(why(head + R"("files":[{"path":7,"size":1}],"gpus":[]})"),
                       "[json.exception.type_error"));
  EXPECT_TRUE(Contains(why(head + R"("files":[]})"), "key 'gpus' not found"));
  EXPECT_TRUE(Contains(why("{\"format\":"), "parse error"));
  std::string many = head + R"("files":[)";
  for (std::size_t k = 0; k <= kMaxDrainFiles; ++k) {
    many += (k == 0 ? "" : ",") + std::string(R"({"path":")") + drain_file_name(7, k) +
            R"(","size":1})";
  }
  EXPECT_EQ(why(many + R"(],"gpus":[]})"), "files: not an array of at most 1024");
  EXPECT_EQ(why(std::string(kMaxIndexBytes + 1, ' ')), "larger than 1 MiB");
}

}  // namespace
}  // namespace gpusnap::tier::folder
