// The GNU build-id a placeholder's files are compared by (container/build_id.h): read from
// headers gpusnap builds here, byte by byte, and from a real executable; anything malformed or
// out of bounds is no build-id, never a read past what the file holds.
#include "container/build_id.h"

#include <elf.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/fd.h"
#include "common/subprocess.h"

namespace gpusnap::container {
namespace {

// A 64-bit ELF with one PT_NOTE segment holding `notes` (aligned to `align`).
std::vector<unsigned char> elf_with_notes(const std::vector<unsigned char>& notes,
                                          uint64_t align = 4) {
  Elf64_Ehdr eh{};
  std::memcpy(eh.e_ident, ELFMAG, SELFMAG);
  eh.e_ident[EI_CLASS] = ELFCLASS64;
  eh.e_ident[EI_DATA] = ELFDATA2LSB;
  eh.e_phoff = sizeof eh;
  eh.e_phentsize = sizeof(Elf64_Phdr);
  eh.e_phnum = 1;
  Elf64_Phdr ph{};
  ph.p_type = PT_NOTE;
  ph.p_offset = sizeof eh + sizeof ph;
  ph.p_filesz = notes.size();
  ph.p_align = align;
  std::vector<unsigned char> out(sizeof eh + sizeof ph);
  std::memcpy(out.data(), &eh, sizeof eh);
  std::memcpy(out.data() + sizeof eh, &ph, sizeof ph);
  out.insert(out.end(), notes.begin(), notes.end());
  return out;
}

// One note: header, name padded to `align`, descriptor padded to `align`.
std::vector<unsigned char> note(uint32_t type, const std::string& name,
                                const std::vector<unsigned char>& desc, uint64_t align = 4) {
  Elf64_Nhdr h{static_cast<Elf64_Word>(name.size() + 1), static_cast<Elf64_Word>(desc.size()),
               type};
  std::vector<unsigned char> out(sizeof h);
  std::memcpy(out.data(), &h, sizeof h);
  out.insert(out.end(), name.begin(), name.end());
  out.push_back(0);
  while (out.size() % align != 0) out.push_back(0);
  out.insert(out.end(), desc.begin(), desc.end());
  while (out.size() % align != 0) out.push_back(0);
  return out;
}

std::optional<std::string> build_id_of(const std::vector<unsigned char>& bytes) {
  common::UniqueFd fd(::memfd_create("elf", MFD_CLOEXEC));
  EXPECT_TRUE(fd.valid());
  EXPECT_EQ(::write(fd.get(), bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  return gnu_build_id(fd.get());
}

const std::vector<unsigned char> kId = {0xde, 0xad, 0xbe, 0xef, 0x01, 0x23};

TEST(GnuBuildId, FoundAfterOtherNotesAsHex) {
  auto notes = note(NT_GNU_ABI_TAG, "GNU", {0, 0, 0, 0, 3, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0});
  auto id = note(NT_GNU_BUILD_ID, "GNU", kId);
  notes.insert(notes.end(), id.begin(), id.end());
  EXPECT_EQ(build_id_of(elf_with_notes(notes)), "deadbeef0123");
  // A segment aligned to 8 pads its notes to 8.
  EXPECT_EQ(build_id_of(elf_with_notes(note(NT_GNU_BUILD_ID, "GNU", kId, 8), 8)), "deadbeef0123");
}

TEST(GnuBuildId, NoneWhereThereIsNone) {
  EXPECT_EQ(build_id_of({}), std::nullopt);
  EXPECT_EQ(build_id_of({'#', '!', '/', 'b', 'i', 'n'}), std::nullopt);
  // A note of another type or owner.
  EXPECT_EQ(build_id_of(elf_with_notes(note(NT_GNU_ABI_TAG, "GNU", kId))), std::nullopt);
  EXPECT_EQ(build_id_of(elf_with_notes(note(NT_GNU_BUILD_ID, "XYZ", kId))), std::nullopt);
  // 32-bit and big-endian files are not read.
  auto elf = elf_with_notes(note(NT_GNU_BUILD_ID, "GNU", kId));
  elf[EI_CLASS] = ELFCLASS32;
  EXPECT_EQ(build_id_of(elf), std::nullopt);
  elf[EI_CLASS] = ELFCLASS64;
  elf[EI_DATA] = ELFDATA2MSB;
  EXPECT_EQ(build_id_of(elf), std::nullopt);
}

TEST(GnuBuildId, OutOfBoundsIsNone) {
  const auto good = elf_with_notes(note(NT_GNU_BUILD_ID, "GNU", kId));
  auto ph_at = [](std::vector<unsigned char>& elf) {
    return reinterpret_cast<Elf64_Phdr*>(elf.data() + sizeof(Elf64_Ehdr));
  };
  // Cut anywhere: never more than what is there.
  for (size_t n = 0; n < good.size(); ++n) {
    EXPECT_EQ(build_id_of({good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n)}),
              std::nullopt)
        << n;
  }
  auto elf = good;
  reinterpret_cast<Elf64_Ehdr*>(elf.data())->e_phnum = kMaxProgramHeaders + 1;
  EXPECT_EQ(build_id_of(elf), std::nullopt);
  elf = good;
  ph_at(elf)->p_offset = ~uint64_t{0} - 2;  // offset + size wraps
  EXPECT_EQ(build_id_of(elf), std::nullopt);
  elf = good;
  ph_at(elf)->p_filesz = kMaxNoteSegmentBytes + 1;
  EXPECT_EQ(build_id_of(elf), std::nullopt);
  // A descriptor larger than its segment.
  elf = good;
  reinterpret_cast<Elf64_Nhdr*>(elf.data() + ph_at(elf)->p_offset)->n_descsz = 0xffffffff;
  EXPECT_EQ(build_id_of(elf), std::nullopt);
  // A build-id longer than any linker makes.
  EXPECT_EQ(build_id_of(elf_with_notes(
                note(NT_GNU_BUILD_ID, "GNU", std::vector<unsigned char>(kMaxBuildIdBytes + 1, 7)))),
            std::nullopt);
}

TEST(GnuBuildId, OfARealExecutableIsWhatReadelfSays) {
  const auto self = std::filesystem::read_symlink("/proc/self/exe").string();
  auto readelf = common::run_capture({"readelf", "-n", self});
  const auto at = readelf.output.find("Build ID: ");
  if (!readelf.status.ok() || at == std::string::npos) GTEST_SKIP() << "skipped: no readelf";
  const std::string expected =
      readelf.output.substr(at + 10, readelf.output.find('\n', at) - at - 10);
  common::UniqueFd fd(::open(self.c_str(), O_RDONLY | O_CLOEXEC));
  EXPECT_EQ(gnu_build_id(fd.get()), expected);
}

}  // namespace
}  // namespace gpusnap::container
